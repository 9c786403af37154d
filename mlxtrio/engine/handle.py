"""The Trio side of one generation: an async iterator of :class:`GenerationEvent`.

The engine thread never touches a handle directly: it hands batches of events to
the Trio loop with one ``TrioToken.run_sync_soon`` per engine step, and
:meth:`GenerationHandle._deliver` runs there. Delivery never blocks; the buffer is
bounded by the sequence's ``max_tokens`` (one event per generated token at most,
plus the final one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from types import TracebackType

import trio

from .image_tokens import VisionPrompt
from .types import GenerationEvent, GenerationStats, Match, SamplingParams


class EngineError(RuntimeError):
    """The engine could not run or finish this generation (not a client error)."""


class EngineUnavailable(EngineError):
    """The engine is not taking work right now (loading, restarting, stopping):
    retrying later may succeed."""


class GenerationHandle:
    """One submitted sequence, seen from Trio.

    Use it as ``async with engine.submit(...) as handle: async for event in handle``.
    Leaving the ``async with`` block for any reason - end of iteration, an
    exception, or cancellation of the surrounding scope (a client disconnect) -
    calls :meth:`cancel`, so the engine never keeps generating for nobody.
    """

    def __init__(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        request_cancel: Callable[[GenerationHandle], None],
        cache_key: Hashable = None,
        match: Match | None = None,
    ) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.cache_key = cache_key
        self.match = match  # a pinned prefix to start from (engine reads entry id and length)
        self.stats = GenerationStats(
            prompt_tokens=len(prompt), cached_tokens=match.length if match else 0
        )
        self.finish_reason: str | None = None
        self._request_cancel = request_cancel
        self._events: deque[GenerationEvent] = deque()
        self._lot = trio.lowlevel.ParkingLot()
        self._done = False  # the final event has been delivered
        self._cancel_requested = False
        # The engine step at which cancel() was asked for (written on the Trio
        # thread; the engine thread reads it to measure cancellation latency).
        self.cancel_requested_at_step: int | None = None
        # Prompt tokens in its KV so far, cached ones included (written by the
        # engine thread; read on the Trio thread by in-flight reuse: a plain
        # int, so a read sees either value).
        self.prefilled = 0
        self.boundary = 0  # where its system prompt ends (set at submit)
        # Its images, for a vision-language model (set at submit): ``prompt``
        # holds their key tokens (see mlxtrio.engine.image_tokens).
        self.vision: VisionPrompt | None = None
        # Names it in commands, across threads and ranks (set at submit).
        self.serial = 0
        # In-flight reuse: when another request waits to start from this one's
        # prompt, the engine is asked to snapshot it once it holds ``share_at``
        # tokens. ``kv_ready`` is set when that snapshot, or the one kept when
        # the sequence ends, has reached the prefix index (or when the sequence
        # ended without one).
        self.share_at = 0
        self.kv_ready = trio.Event()

    # -- Trio-facing API -------------------------------------------------

    def cancel(self) -> None:
        """Ask the engine to drop this sequence at its next safepoint.

        Synchronous and non-blocking; safe to call any number of times, before or
        after the sequence finished. The final event (``finish_reason ==
        "cancelled"``) still arrives if anybody keeps iterating.
        """
        if self._cancel_requested or self._done:
            return
        self._cancel_requested = True
        self._request_cancel(self)

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    @property
    def done(self) -> bool:
        return self._done

    async def __aenter__(self) -> GenerationHandle:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    def __aiter__(self) -> GenerationHandle:
        return self

    async def __anext__(self) -> GenerationEvent:
        """Wait for the next event.

        A checkpoint: cancelling the calling scope raises ``trio.Cancelled`` here
        (the sequence itself is cancelled by ``__aexit__``). Raises
        :class:`EngineError` if the engine failed this sequence, and
        ``StopAsyncIteration`` after the final event.
        """
        if self._events:
            await trio.lowlevel.checkpoint()
        while not self._events:
            if self._done:
                raise StopAsyncIteration
            await self._lot.park()
        event = self._events.popleft()
        if event.error is not None:
            raise EngineError(event.error)
        return event

    # -- engine-facing API (runs on the Trio thread via run_sync_soon) ----

    def _deliver(self, event: GenerationEvent) -> None:
        if self._done:
            return
        self._events.append(event)
        if event.finish_reason is not None or event.error is not None:
            self._done = True
            self.kv_ready.set()
            self.finish_reason = event.finish_reason
            if event.stats is not None:
                self.stats = event.stats
        self._lot.unpark_all()


class LiveHandles:
    """The handles submitted and not yet terminated, as the Trio side sees
    them, and whether there are none (the engine is idle). Trio thread only."""

    def __init__(self) -> None:
        self._handles: set[GenerationHandle] = set()
        self._idle = trio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._handles)

    def __iter__(self) -> Iterator[GenerationHandle]:
        return iter(list(self._handles))

    def add(self, handle: GenerationHandle) -> None:
        self._handles.add(handle)
        if self._idle.is_set():
            self._idle = trio.Event()

    def deliver(self, deliveries: Iterable[tuple[GenerationHandle, GenerationEvent]]) -> None:
        """Hand each event to its handle; a handle's terminal event ends it here."""
        for handle, event in deliveries:
            handle._deliver(event)
            if handle.done:
                self._handles.discard(handle)
        if not self._handles:
            self._idle.set()

    def end_all(self, error: str | None) -> None:
        """Give every open handle its terminal event: ``error``, or cancelled."""
        for handle in list(self._handles):
            if error is None:
                event = GenerationEvent(finish_reason="cancelled", stats=handle.stats)
            else:
                event = GenerationEvent(error=error)
            handle._deliver(event)
        self._handles.clear()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Wait until no handle is open. Cancelling it cancels only the wait."""
        await self._idle.wait()
