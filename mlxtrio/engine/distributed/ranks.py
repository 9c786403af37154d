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
from functools import partial
from typing import Any, cast

from ..config import EngineConfig
from ..loop import LoopSettings
from ..model import Checkpoint, LoadedModel, load_model
from ..precision import apply_compute_dtype
from ..sizing import auto_capacity
from .doorbell import Doorbell, open_doorbell
from .world import Link, World

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
    def for_leader(cls, name: str, path: str, config: EngineConfig, loop: LoopSettings) -> RankPlan:
        """Rank 0's plan for its engine's model (a fresh seed)."""
        return cls(
            name=name,
            path=path,
            compute_dtype=config.compute_dtype,
            sharding=config.sharding,
            loop=loop,
            seed=new_seed(),
            rank_timeout=config.rank_timeout,
            shutdown_grace=config.shutdown_grace,
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankPlan:
        return cls(**{**data, "loop": LoopSettings(**data["loop"])})


def new_seed() -> int:
    return secrets.randbits(63)


def read_shard(world: World, sharding: str, path: str) -> Checkpoint:
    """This rank's shard of the model at ``path``, with mlx-lm's sharding:
    ``tensor`` parallel (each layer's heads and MLP split across the ranks;
    every step runs on all of them), ``pipeline`` parallel (consecutive
    layers per rank), or ``auto``: tensor where the model supports it, else
    pipeline. Every rank calls it together; it returns once every rank has."""
    from mlx_lm.utils import sharded_load

    groups = {
        "auto": {},
        "tensor": {"tensor_group": world.group},
        "pipeline": {"pipeline_group": world.group},
    }[sharding]
    loaded = sharded_load(path, return_config=True, **groups)  # type: ignore[arg-type]
    return cast(Checkpoint, loaded)


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
    read = partial(read_shard, link.world, plan.sharding)
    loaded = load_model(plan.name, plan.path, plan.compute_dtype, read)
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
    pids = tuple(pid for pid, _ in gathered)
    if link.world.leader:
        log.info(
            "model %s is sharded across %d ranks (pids %s)",
            plan.name,
            link.world.size,
            ", ".join(map(str, pids)),
        )
    return OpenRanks(plan, loaded, pids, doorbell)


def resolved_capacity(setting: int, loaded: LoadedModel) -> int:
    """``setting``, or the auto capacity for ``loaded`` when it is 0."""
    return setting or auto_capacity(loaded.config, loaded.dtype)


def _digest(config: dict[str, Any]) -> int:
    """A signed 63-bit name for a model configuration."""
    text = json.dumps(config, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1
