"""Capacity-limited admission lane: ``capacity`` running requests per model plus a
bounded waiting room. A request that finds the waiting room full is refused at
once (HTTP 429) instead of queueing without bound.

Two steps, so that the refusal can be decided *before* response headers go out
while the wait itself may happen later (inside a streaming body, with keepalives):

    ticket = lane.reserve()          # synchronous; raises QueueFull
    try:
        async with ticket:           # waits for a slot (a Trio checkpoint)
            ...                      # the slot is held here
    finally:
        ticket.release()             # idempotent; also frees an unused reservation

Waiting is an ordinary Trio wait: a request cancelled while queued (its client
went away) leaves the queue at once and never reaches the engine.
"""

from __future__ import annotations

from types import TracebackType

import trio


class QueueFull(Exception):
    """The waiting room is full; retry after ``retry_after`` seconds."""

    def __init__(self, what: str, capacity: int, waiting_room: int) -> None:
        super().__init__(
            f"Queue full: {what} is running {capacity} request(s) and "
            f"{waiting_room} more are waiting. Retry after 1s."
        )
        self.retry_after = 1


class AdmissionLane:
    """``what`` names the lane in refusals (e.g. ``model 'qwen'``)."""

    def __init__(self, what: str, capacity: int, waiting_room: int) -> None:
        self.what = what
        self.capacity = capacity
        self.waiting_room = waiting_room
        self._slots = trio.Semaphore(capacity)  # FIFO-fair
        self._reserved = 0  # tickets issued and not yet holding a slot
        self.running = 0

    def resize(self, capacity: int) -> None:
        """Change the capacity of a lane nobody uses yet (the model's batch
        size, once it is known)."""
        if self.running or self._reserved:
            raise RuntimeError("resizing a lane in use")
        self.capacity = capacity
        self._slots = trio.Semaphore(capacity)

    @property
    def waiting(self) -> int:
        """Requests admitted to the waiting room that do not hold a slot yet."""
        return self._reserved

    def reserve(self) -> Ticket:
        """Claim a place in the lane, or raise :class:`QueueFull` immediately."""
        free_slots = self._slots.value
        if self._reserved >= free_slots + self.waiting_room:
            raise QueueFull(self.what, self.capacity, self.waiting_room)
        self._reserved += 1
        return Ticket(self)


class Ticket:
    """One request's place in an :class:`AdmissionLane`."""

    def __init__(self, lane: AdmissionLane) -> None:
        self._lane = lane
        self._state = "reserved"  # -> "running" -> "released"

    async def __aenter__(self) -> Ticket:
        """Wait for a slot. Cancellation while waiting leaves the queue cleanly."""
        if self._state != "reserved":
            raise RuntimeError("ticket already used")
        await self._lane._slots.acquire()
        self._lane._reserved -= 1
        self._lane.running += 1
        self._state = "running"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        """Give back the slot or the reservation; does nothing the second time."""
        if self._state == "reserved":
            self._lane._reserved -= 1
        elif self._state == "running":
            self._lane.running -= 1
            self._lane._slots.release()
        self._state = "released"
