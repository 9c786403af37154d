"""Opening one model across the ranks of a distributed world.

Rank 0 decides everything a lock-step engine loop depends on (:class:`RankPlan`:
the model, its compute type, the loop's settings, the sampling seed) and tells
the other ranks, whatever their own command line or environment says; then
every rank loads its shard, adopts rank 0's compute type (``auto`` may resolve
differently on machines with different BLAS libraries, and ranks that compute
in different types would sample different tokens), checks that all ranks hold
the same model, and seeds the global sampler alike: samplers without a
request seed draw from MLX's global key, which must advance alike everywhere.

Blocking collectives throughout: the engine thread of rank 0, or the main
work of another rank. Raises :class:`RankMismatch` when the ranks disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from .doorbell import Doorbell, open_doorbell
from .loop import LoopSettings
from .model import LoadedModel, load_model
from .precision import apply_compute_dtype
from .sizing import auto_capacity
from .world import Link

log = logging.getLogger("mlxtrio.engine")


class RankMismatch(RuntimeError):
    """The ranks did not open the same model."""


@dataclass(frozen=True)
class RankPlan:
    """What rank 0 decides for every rank."""

    name: str
    path: str
    compute_dtype: str  # the setting; rank 0's resolved type follows the load
    sharding: str
    loop: LoopSettings
    seed: int
    rank_timeout: float  # seconds a round may take before the world is given up
    shutdown_grace: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankPlan:
        return cls(**{**data, "loop": LoopSettings(**data["loop"])})


def new_seed() -> int:
    return secrets.randbits(63)


@dataclass(frozen=True)
class OpenRanks:
    plan: RankPlan
    loaded: LoadedModel
    pids: tuple[int, ...]  # each rank's process id, in rank order
    doorbell: Doorbell


def open_ranks(link: Link, plan: RankPlan | None = None) -> OpenRanks:
    """Rank 0 passes its plan, the others None; every rank returns the plan
    its loaded shard, and the doorbell of its lock-step rounds."""
    import mlx.core as mx

    plan = RankPlan.from_json(link.share_json(dataclasses.asdict(plan) if plan else None))
    loaded = load_model(plan.name, plan.path, plan.compute_dtype, link.world, plan.sharding)
    # Rank 0's compute type, and its batch size when that is auto (both are
    # known only once the model is loaded).
    settled = link.share_json(
        {"dtype": loaded.dtype, "capacity": resolved_capacity(plan.loop.capacity, loaded)}
        if link.world.leader
        else None
    )
    plan = dataclasses.replace(
        plan, loop=dataclasses.replace(plan.loop, capacity=settled["capacity"])
    )
    dtype = settled["dtype"]
    if loaded.dtype != dtype:
        log.info("rank %d computes in rank 0's %s, not %s", link.world.rank, dtype, loaded.dtype)
        apply_compute_dtype(loaded.model, dtype)
        loaded.dtype = dtype
    gathered = link.gather_ints([os.getpid(), _digest(loaded.config)])
    if len({digest for _, digest in gathered}) > 1:
        raise RankMismatch(
            f"the ranks loaded different models from {plan.path!r} "
            "(their configurations differ): every machine needs the same files"
        )
    mx.random.seed(plan.seed)
    doorbell = open_doorbell(link)
    return OpenRanks(plan, loaded, tuple(pid for pid, _ in gathered), doorbell)


def resolved_capacity(setting: int, loaded: LoadedModel) -> int:
    """``setting``, or the auto capacity for ``loaded`` when it is 0."""
    return setting or auto_capacity(loaded.config, loaded.dtype)


def _digest(config: dict[str, Any]) -> int:
    """A signed 63-bit name for a model configuration."""
    text = json.dumps(config, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1
