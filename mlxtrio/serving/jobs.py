"""Background responses: jobs that outlive the request that started them.

A job runs in the server's nursery, not in a request's, so a client can start
it, hang up, and come back: to poll its state, to read its events again from
any point (every event is kept in the job's :class:`EventLog` while the job is
known), or to cancel it. This module knows nothing about HTTP or the Responses
wire format; it only keeps events in order and wakes their readers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

Event = tuple[str, dict[str, Any]]


class EventLog:
    """An append-only list of events with any number of readers, each able to
    start after any position and follow the log live until it is closed."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.closed = False
        self._changed = trio.Event()

    async def append(self, event: str, data: dict[str, Any]) -> None:
        """Add one event (never blocks: readers that fall behind read later).
        An ``async`` emit so a log can stand where a socket would."""
        self.events.append((event, data))
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def follow(self, after: int = 0) -> AsyncIterator[Event]:
        """Events from index ``after`` on, then live ones until the log closes.

        Cancellation: waiting for the next event is a checkpoint; cancelling
        the reader leaves the log (and its writer) untouched."""
        position = after
        while True:
            while position < len(self.events):
                yield self.events[position]
                position += 1
            if self.closed:
                return
            await self._changed.wait()


@dataclass
class Job:
    """One background response: its id, who may see it, its current state,
    its events and the cancel scope of its generation (set once it starts)."""

    id: str
    owner: str
    snapshot: Callable[[], dict[str, Any]]  # the response as it stands now
    log: EventLog = field(default_factory=EventLog)
    done: trio.Event = field(default_factory=trio.Event)
    cancel_requested: bool = False
    finished_at: float | None = None
    _scope: trio.CancelScope | None = None

    def running_in(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        if self.cancel_requested:
            scope.cancel()

    def cancel(self) -> None:
        """Ask the job to stop at the engine's next safepoint (idempotent; a job
        not generating yet stops before it starts)."""
        self.cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    def finish(self) -> None:
        self.log.close()
        self.finished_at = time.monotonic()
        self.done.set()


class JobRegistry:
    """The jobs this process knows: running ones, and finished ones for
    ``keep_finished`` seconds (at most ``max_finished`` of them) so their
    streams can still be replayed; the stored response outlives both."""

    def __init__(self, keep_finished: float = 600.0, max_finished: int = 256) -> None:
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._keep = keep_finished
        self._max_finished = max_finished

    def add(self, job: Job) -> None:
        self._prune()
        self._jobs[job.id] = job

    def get(self, job_id: str) -> Job | None:
        self._prune()
        return self._jobs.get(job_id)

    def running(self) -> list[Job]:
        return [job for job in self._jobs.values() if job.finished_at is None]

    def forget(self, job_id: str) -> None:
        """Drop a job (its response was deleted); no-op if unknown."""
        self._jobs.pop(job_id, None)

    def _prune(self) -> None:
        now = time.monotonic()
        finished = [j for j in self._jobs.values() if j.finished_at is not None]
        excess = len(finished) - self._max_finished
        for job in finished:
            assert job.finished_at is not None
            if excess > 0 or now - job.finished_at > self._keep:
                del self._jobs[job.id]
                excess -= 1
