"""Server-sent events: framing, keepalive and the drain deadline.

A streaming response is split in two:

* a *producer* task, started in the request's nursery, does the work (admission,
  generation) and sends frames into a small memory channel;
* the response *body* - an async generator Quart iterates - forwards frames to the
  socket, and sends a keepalive whenever nothing was produced for ``keepalive``
  seconds (queueing, long prefill).

Backpressure: while the socket cannot take more, Quart does not resume the body,
so the channel fills and the producer waits in ``send``; the engine never does
(its events buffer in the generation handle). A watchdog treats a write that makes
no progress for ``drain_timeout`` seconds as a disconnect and cancels the request
scope. When the client goes away, the request scope is cancelled, which cancels
the producer, which cancels its generation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

log = logging.getLogger("mlxtrio.http")

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}

COMMENT_KEEPALIVE = b": keepalive\n\n"
# What EventSink.send raises once the response body is gone (the client left).
CLIENT_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


def frame(event: str, data: dict[str, Any]) -> bytes:
    """One SSE frame with an ``event:`` line (none when ``event`` is empty, as
    Chat Completions streams have none) and a JSON ``data:`` line."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if not event:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()


class EventSink:
    """What a producer writes to. ``send`` waits while the client is slow.

    It counts the events sent and notes whether one of the API's terminal
    events (``terminal``) went out, for :class:`EventStream`'s last resort."""

    def __init__(
        self, channel: trio.MemorySendChannel[bytes], terminal: frozenset[str] = frozenset()
    ) -> None:
        self._channel = channel
        self._terminal = terminal
        self.sent = 0
        self.ended = False

    async def send(self, event: str, data: dict[str, Any]) -> None:
        await self._channel.send(frame(event, data))
        self.sent += 1
        self.ended = self.ended or event in self._terminal

    async def send_frame(self, raw: bytes, *, terminal: bool = False) -> None:
        """A frame written by the API itself (Chat Completions ends its
        streams with ``data: [DONE]``); ``terminal``: it ends the stream."""
        await self._channel.send(raw)
        self.sent += 1
        self.ended = self.ended or terminal


Producer = Callable[[EventSink], Awaitable[None]]


@dataclass(frozen=True)
class StreamEnding:
    """How one API ends a stream: its terminal event names, and the frame that
    ends a stream whose producer failed without sending one (given the number
    of events already sent, for APIs that number their events). Each API
    package defines its own."""

    terminal: frozenset[str]
    last_words: Callable[[int], bytes]


class EventStream:
    """Run ``producer`` in ``nursery`` and expose its frames as a response body.

    Producers end every stream with ``ending``'s terminal event, failures
    included; should one raise without having sent it (a bug), the stream ends
    with the API's last words instead of none. :attr:`delivered` tells,
    once the request is over, whether every frame - the terminal event included
    - was handed to the transport, i.e. whether the client stayed to the end.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        producer: Producer,
        ending: StreamEnding,
        *,
        keepalive: float,
        drain_timeout: float,
        keepalive_frame: bytes = COMMENT_KEEPALIVE,
        buffer: int = 16,
    ) -> None:
        self.delivered = False
        self._ending = ending
        self._keepalive = keepalive
        self._keepalive_frame = keepalive_frame
        self._drain_timeout = drain_timeout
        self._pending_since: float | None = None
        send, self._receive = trio.open_memory_channel[bytes](buffer)
        self._scope = nursery.cancel_scope
        nursery.start_soon(self._run_producer, producer, send)
        nursery.start_soon(self._watch_drain)

    async def _run_producer(self, producer: Producer, send: trio.MemorySendChannel[bytes]) -> None:
        async with send:
            sink = EventSink(send, self._ending.terminal)
            try:
                await producer(sink)
            except CLIENT_GONE:
                pass  # the body is gone: the client left
            except Exception:
                # Producers catch their own failures and send a terminal event;
                # this guard is for a bug in that: the process goes on, and the
                # client still learns that the stream is over.
                log.exception("stream producer failed")
                if not sink.ended:
                    with contextlib.suppress(*CLIENT_GONE):
                        await send.send(self._ending.last_words(sink.sent))

    async def _watch_drain(self) -> None:
        """Cancel the request when one write has been stuck for drain_timeout."""
        interval = min(1.0, self._drain_timeout / 4)
        while True:
            await trio.sleep(interval)
            since = self._pending_since
            if since is not None and trio.current_time() - since > self._drain_timeout:
                log.warning(
                    "client stopped reading for %.0f s; dropping stream", self._drain_timeout
                )
                self._scope.cancel()
                return

    async def body(self) -> AsyncIterator[bytes]:
        """The response body. Ends when the producer is done."""
        async with self._receive:
            while True:
                chunk: bytes | None = None
                with trio.move_on_after(self._keepalive if self._keepalive > 0 else math.inf):
                    try:
                        chunk = await self._receive.receive()
                    except trio.EndOfChannel:
                        self.delivered = True  # the transport took every frame
                        return
                self._pending_since = trio.current_time()
                yield self._keepalive_frame if chunk is None else chunk
                self._pending_since = None
