"""Where the engine loop takes its commands at each safepoint.

:class:`LocalSchedule` serves one process: the Trio side's queue. A model
sharded across ranks uses :mod:`.distributed.lockstep`'s schedules instead,
which give every rank the same commands in the same order.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Protocol

from .commands import Command, Shutdown, freeze

Report = Callable[[], Sequence[int]]  # this rank's state (live, steps, snapshots), now


class Schedule(Protocol):
    """What the engine loop asks at each safepoint (``report``: its state)."""

    def commands(self, block: bool, report: Report) -> list[Command]:
        """The commands to apply now (``block``: nothing runs, so wait for one)."""
        ...

    def agree(self, commands: list[Command], chunk: int, report: Report) -> int:
        """The prefill chunk for the next step, once ``commands`` were applied
        (``chunk``: what this rank would choose)."""
        ...


class LocalSchedule:
    """One process: commands from the queue, the chunk as chosen."""

    def __init__(self, commands: queue.SimpleQueue[Command], idle_wait: float | None = None):
        self._queue = commands
        self._idle_wait = idle_wait  # the longest wait for a command (None: forever)

    def commands(self, block: bool, report: Report) -> list[Command]:
        taken: list[Command] = []
        while True:
            try:
                wait = block and not taken
                command = self._queue.get(block=wait, timeout=self._idle_wait if wait else None)
            except queue.Empty:
                return taken
            taken.append(freeze(command))
            if isinstance(command, Shutdown):
                return taken  # what follows a shutdown is never applied

    def agree(self, commands: list[Command], chunk: int, report: Report) -> int:
        return chunk
