"""The ranks of a model served across processes (``mlx.launch``, MLX's
distributed layer).

Under ``mlx.launch`` every rank runs ``python -m mlxtrio serve``; each joins
the world here before anything else. Rank 0 serves HTTP and runs the engine as
usual; every other rank runs the same engine loop on its shard of the model,
applying the commands rank 0 broadcasts at each safepoint (:mod:`.lockstep`).

:class:`Link` carries that control traffic: sums of small integer vectors and
byte payloads, as ``mx.distributed.all_sum`` on the CPU stream. Each of its
calls blocks until every rank has made the same call; it is for the engine
thread only (or the main thread of a rank that serves no HTTP), never Trio's.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mlxtrio.engine")

# Set by the launchers MLX's distributed layer works with: mlx.launch (ring,
# jaccl: MLX_RANK and MLX_HOSTFILE; nccl: MLX_WORLD_SIZE) and mpirun.
LAUNCHER_VARIABLES = (
    "MLX_RANK",
    "MLX_HOSTFILE",
    "MLX_WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks: ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the mx.distributed.Group (None in a world of one)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


SOLO = World()


def launched() -> bool:
    """Whether a distributed launcher started this process."""
    return any(os.environ.get(name) for name in LAUNCHER_VARIABLES)


def join_world() -> World:
    """Join the ranks a launcher started (blocking until every rank has
    connected), or :data:`SOLO` when none did. Raises RuntimeError when the
    launcher's backend cannot connect the ranks."""
    if not launched():
        return SOLO
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() == 1:
        return SOLO
    world = World(group.rank(), group.size(), group)
    log.info("rank %d of %d joined the distributed world", world.rank, world.size)
    return world


class Link:
    """Collectives among the ranks of ``world`` for control data (blocking).

    Every rank must make the same collectives in the same order. mlx-lm's
    ``BatchGenerator`` starts each next forward pass (itself full of
    collectives, for a sharded model) before a step returns; so each call
    here first waits for the generation stream's work to end, or this
    rank's control data could meet another rank's activations."""

    def __init__(self, world: World) -> None:
        self.world = world

    def _settle(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        mx.synchronize(generation_stream)

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        """The element-wise sum of every rank's ``values`` (equal lengths)."""
        import mlx.core as mx

        self._settle()
        total = mx.distributed.all_sum(
            mx.array(list(values), dtype=mx.int64), group=self.world.group, stream=mx.cpu
        )
        return [int(v) for v in total.tolist()]  # type: ignore[arg-type, union-attr]

    def gather_ints(self, own: Sequence[int]) -> list[list[int]]:
        """Every rank's ``own`` (the same length on each), in rank order."""
        width, rank = len(own), self.world.rank
        slots = [0] * (width * self.world.size)
        slots[rank * width : (rank + 1) * width] = own
        summed = self.sum_ints(slots)
        return [summed[r * width : (r + 1) * width] for r in range(self.world.size)]

    def broadcast(self, payload: bytes | None, size: int) -> bytes:
        """Rank 0's ``payload`` of ``size`` bytes, on every rank (the others
        pass None)."""
        import mlx.core as mx
        import numpy as np

        if size == 0:
            return b""
        self._settle()
        mine = np.frombuffer(payload, dtype=np.uint8) if payload else np.zeros(size, np.uint8)
        total = mx.distributed.all_sum(mx.array(mine), group=self.world.group, stream=mx.cpu)
        return bytes(np.array(total, copy=False))

    def share_json(self, value: Any = None) -> Any:
        """Rank 0's ``value`` (JSON data) on every rank; the others pass None."""
        payload = json.dumps(value).encode() if self.world.leader else b""
        (size,) = self.sum_ints([len(payload)])
        return json.loads(self.broadcast(payload or None, size))
