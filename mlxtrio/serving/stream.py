"""Streaming a prepared turn: one producer for every API, and the guarantee
that every stream ends with exactly one terminal event.

An API supplies its :class:`TurnEvents` (its event assembler: what its wire
events are, and how its stream ends or fails); :func:`produce` drives it
through the turn. Whatever happens - a finished turn, the server cancelling it
at shutdown, an error that is the server's, a bug - the stream ends with the
API's terminal event, except when the client left (then nobody reads it, and
the exception that says so propagates to end the producer).

:func:`event_stream` runs a producer as an SSE response body in the call's
nursery, with keepalives while nothing is produced and the drain deadline
(:mod:`mlxtrio.http.sse`).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Protocol

from quart import Response

from ..chat.output import Segment
from ..chat.turn import TurnResult
from ..http.errors import ApiError
from ..http.sse import (
    CLIENT_GONE,
    COMMENT_KEEPALIVE,
    SSE_HEADERS,
    EventStream,
    Producer,
    StreamEnding,
)
from .call import call_nursery, services
from .pipeline import SHUTDOWN_MESSAGE, PreparedTurn

log = logging.getLogger("mlxtrio.stream")


class FailureKind(enum.Enum):
    SHUTDOWN = "shutdown"  # the server cancelled the turn: it is shutting down
    ERROR = "error"  # an ApiError after the stream started (the engine failed)
    BUG = "bug"  # an unexpected exception: "internal server error"


@dataclass(frozen=True)
class Failure:
    """Why a started stream ends without a finished turn."""

    kind: FailureKind
    message: str
    error: ApiError | None = None


SHUTDOWN = Failure(FailureKind.SHUTDOWN, SHUTDOWN_MESSAGE)
BUG = Failure(FailureKind.BUG, "internal server error")


class TurnEvents(Protocol):
    """An API's events for one turn, as :func:`produce` drives them."""

    async def start(self) -> None:
        """The stream's opening events (before the admission slot is held)."""

    async def admitted(self) -> None:
        """The turn holds its admission slot and starts generating."""

    async def on_segment(self, segment: Segment) -> None:
        """One parsed piece of output: text, reasoning or a tool call."""

    async def finish(self, result: TurnResult) -> None:
        """The turn ended (stop, length, a stop sequence): its last events,
        the terminal one included."""

    async def fail(self, failure: Failure) -> None:
        """The turn cannot finish: the API's terminal failure event(s)."""


async def produce(turn: PreparedTurn, events: TurnEvents) -> None:
    """Generate ``turn`` through ``events``, ending with exactly one terminal
    event. Cancellation (the client left, the call ended) stops generation at
    the engine's next safepoint; an exception raised because the client left
    (:data:`~mlxtrio.http.sse.CLIENT_GONE`) propagates."""
    try:
        await events.start()
        result = await turn.run(events.on_segment, events.admitted)
        if result.finish_reason == "cancelled":  # only the server cancels a live stream
            await events.fail(SHUTDOWN)
            return
        await events.finish(result)
    except ApiError as exc:
        await events.fail(Failure(FailureKind.ERROR, exc.message, exc))
    except CLIENT_GONE:
        raise
    except Exception:  # a bug: the stream still ends with its terminal event
        log.exception("a %s stream failed", turn.engine.name)
        await events.fail(BUG)


def event_stream(
    produce: Producer,
    ending: StreamEnding,
    headers: dict[str, str],
    keepalive_frame: bytes = COMMENT_KEEPALIVE,
) -> tuple[Response, EventStream]:
    """An SSE response whose body ``produce`` writes, run in the call's
    nursery (cancelled when the client leaves); also the stream, which says
    once the call is over whether the client took every frame."""
    settings = services().settings
    stream = EventStream(
        call_nursery(),
        produce,
        ending,
        keepalive=settings.sse_keepalive,
        drain_timeout=settings.sse_drain_timeout,
        keepalive_frame=keepalive_frame,
    )
    response = Response(stream.body(), status=200, headers={**SSE_HEADERS, **headers})
    response.timeout = None  # our drain deadline replaces Quart's 60 s response timeout
    return response, stream
