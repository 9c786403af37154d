"""One API call's scope: what it owns, whatever carries it - an HTTP request,
one turn on a WebSocket, or a background response that outlives its request.

Everything on the request path finds the call it runs in through a context
variable: the server's :class:`~.services.Services`, the call's nursery (its
stream producers and watchdogs), the cleanups that release what it holds, and
its access-log record.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..http import access_log
from ..http.access_log import AccessRecord

if TYPE_CHECKING:  # services.py builds engines and stores; only its type is needed here
    from .services import Services

log = logging.getLogger("mlxtrio")


@dataclass
class CallScope:
    """``nursery`` holds the call's helper tasks (stream producers, watchdogs);
    it is cancelled when the call is over. ``cleanups`` release what the call
    holds (its admission place, its pinned cache prefix) exactly once, however
    it ends. ``record`` becomes its access-log line."""

    services: Services
    nursery: trio.Nursery
    record: AccessRecord
    cleanups: list[Callable[[], None]] = field(default_factory=list)


_current: ContextVar[CallScope | None] = ContextVar("mlxtrio_call_scope", default=None)


@contextlib.asynccontextmanager
async def open_call_scope(services: Services, record: AccessRecord) -> AsyncIterator[CallScope]:
    """Run the body as one call: tasks started in the scope's nursery and the
    :func:`on_call_end` callbacks registered within belong to it.

    On exit the nursery is cancelled (the body is done, so whatever still runs
    there is a helper that has no one to serve), then every cleanup runs - each
    whatever the others do - and the access line is written."""
    scope: CallScope | None = None
    try:
        async with trio.open_nursery() as nursery:
            scope = CallScope(services, nursery, record)
            token = _current.set(scope)
            try:
                yield scope
            finally:
                _current.reset(token)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The body's own error (an ApiError, say) comes out as itself, not
        # wrapped in the group the nursery makes of it.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise
    finally:
        for cleanup in scope.cleanups if scope is not None else ():
            try:
                cleanup()
            except Exception:
                log.exception("call cleanup failed")
        access_log.write(record)


def current_scope() -> CallScope:
    scope = _current.get()
    if scope is None:
        raise RuntimeError("not within an API call (open_call_scope)")
    return scope


def services() -> Services:
    """The server's long-lived parts, as the current call sees them."""
    return current_scope().services


def call_nursery() -> trio.Nursery:
    """A nursery that lives as long as this call: it is cancelled when the
    response has been sent or the client went away."""
    return current_scope().nursery


def on_call_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the call ends, however it ends (even if a
    streaming body was never started)."""
    current_scope().cleanups.append(callback)


def access_record() -> AccessRecord:
    """This call's access-log record (routes fill in what they know); a
    throwaway one outside any call."""
    scope = _current.get()
    return scope.record if scope is not None else AccessRecord("?", "?")
