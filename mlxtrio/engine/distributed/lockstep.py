"""Where the engine loop takes its commands: the Trio side's queue, and, for a
model sharded across ranks, the same commands on every rank in the same order.

A sharded model's forward pass is a collective: every rank must run the same
``BatchGenerator`` steps, with the same sequences inserted and removed at the
same safepoints and the same prefill size, or the ranks' collectives stop
matching (wrong output, or a hang). So at each safepoint the ranks hold a
*round*:

* rank 0 takes the commands queued since the last round (frozen as it takes
  them, see :func:`..commands.freeze`), applies them, sizes the next prefill
  chunk by time, and sends both: a header of integers (the payload's length,
  the chunk) summed over the ranks, then, when there are commands, their wire
  form;
* every other rank receives them, applies the same commands and uses rank 0's
  chunk: what each rank does is a function of rank 0's decisions alone;
* each rank adds its state as it was before the round's commands (sequences
  live, steps taken, KV snapshots held): equal on every rank while they are
  in step, so rank 0 ends the world at the first difference (a rank that
  failed alone, or computes differently) instead of letting it run on with
  parted batches; ``/health`` shows them
  (``/health`` shows it).

An idle rank 0 holds a round every :data:`HEARTBEAT` seconds, so a rank that
stopped answering is noticed even when nothing runs; it rings the other ranks'
:mod:`.doorbell` before each round, so that they wait for it without spinning.
Every schedule method blocks (a round waits for every rank); engine thread
only.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..commands import Command, decode, encode
from ..handle import GenerationHandle
from ..schedule import LocalSchedule, Report
from .doorbell import Doorbell
from .world import Link

HEARTBEAT = 1.0  # seconds between rounds while rank 0 is idle

# What each rank reports of itself in every round.
REPORT_FIELDS = ("live", "steps", "snapshots")


@dataclass(frozen=True)
class RankState:
    """One rank as of the latest round."""

    rank: int
    live: int  # sequences in its batch
    steps: int  # engine steps taken
    snapshots: int  # prefix-cache KV snapshots held


class RankDivergence(RuntimeError):
    """A rank's state parted from rank 0's: the world cannot go on."""


class LeaderSchedule(LocalSchedule):
    """Rank 0: commands from the queue, sent to every other rank in each round."""

    def __init__(
        self, commands: queue.SimpleQueue[Command], link: Link, doorbell: Doorbell
    ) -> None:
        super().__init__(commands, idle_wait=HEARTBEAT)
        self._link = link
        self._doorbell = doorbell
        self.last_round = time.monotonic()
        self.ranks = tuple(RankState(r, 0, 0, 0) for r in range(link.world.size))
        self._before: Sequence[int] = ()

    def commands(self, block: bool, report: Report) -> list[Command]:
        self._before = report()  # what the other ranks report in this round
        return super().commands(block, report)

    def agree(self, commands: list[Command], chunk: int, report: Report) -> int:
        payload = encode(commands) if commands else b""
        self._doorbell.ring()
        _, _, self.ranks = _round(self._link, len(payload), chunk, self._before)
        self._link.broadcast(payload, len(payload))
        self.last_round = time.monotonic()
        leader = self.ranks[0]
        for rank in self.ranks[1:]:
            if (rank.live, rank.steps, rank.snapshots) != (
                leader.live,
                leader.steps,
                leader.snapshots,
            ):
                raise RankDivergence(
                    f"rank {rank.rank} is out of step with rank 0 ({_state(rank)} against "
                    f"{_state(leader)})"
                )
        return chunk


class FollowerSchedule:
    """Any other rank: rank 0's commands and chunks, round by round.

    ``handles`` holds this rank's copies of the sequences rank 0 submitted,
    by serial number, until :meth:`ended` is told they ended."""

    def __init__(
        self, link: Link, doorbell: Doorbell, compile_grammar: Callable[[str], Any]
    ) -> None:
        self._link = link
        self._doorbell = doorbell
        self._compile_grammar = compile_grammar
        self._chunk = 0
        self.handles: dict[int, GenerationHandle] = {}
        self.last_round = time.monotonic()

    def commands(self, block: bool, report: Report) -> list[Command]:
        self._doorbell.wait()
        size, self._chunk, _ = _round(self._link, 0, 0, report())
        payload = self._link.broadcast(None, size)
        self.last_round = time.monotonic()
        return decode(payload, self.handles, self._compile_grammar) if size else []

    def agree(self, commands: list[Command], chunk: int, report: Report) -> int:
        return self._chunk

    def ended(self, handle: GenerationHandle) -> None:
        self.handles.pop(handle.serial, None)


def _round(
    link: Link, payload_size: int, chunk: int, report: Sequence[int]
) -> tuple[int, int, tuple[RankState, ...]]:
    """One header exchange: rank 0's payload size and chunk, every rank's report."""
    world, width = link.world, len(REPORT_FIELDS)
    values = [payload_size, chunk] + [0] * (width * world.size)
    start = 2 + world.rank * width
    values[start : start + width] = report
    summed = link.sum_ints(values)
    ranks = tuple(
        RankState(r, *summed[2 + r * width : 2 + (r + 1) * width]) for r in range(world.size)
    )
    return summed[0], summed[1], ranks


def _state(rank: RankState) -> str:
    return f"{rank.live} sequences, {rank.steps} steps, {rank.snapshots} KV snapshots"
