"""What route handlers need from the app and the request scope."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import cast

import trio
from quart import current_app

from ..engine.engine import Engine, EngineState
from ..engine.registry import UnknownModel
from ..http import access_log
from ..http.access_log import AccessRecord
from ..http.errors import ApiError, not_found, unavailable
from ..services import Services

log = logging.getLogger("mlxtrio")


def services() -> Services:
    return cast(Services, current_app.extensions["mlxtrio"])


@dataclass
class CallScope:
    """What one API call owns, whatever carries it: an HTTP request, one turn
    on a WebSocket, or a background response that outlives its request.

    ``nursery`` holds the call's helper tasks (stream producers, watchdogs); it
    is cancelled when the call is over. ``cleanups`` release what the call
    holds (its admission place, its pinned cache prefix) exactly once, however
    it ends. ``record`` becomes its access-log line."""

    nursery: trio.Nursery
    record: AccessRecord
    cleanups: list[Callable[[], None]] = field(default_factory=list)


_current: ContextVar[CallScope | None] = ContextVar("mlxtrio_call_scope", default=None)


@contextlib.asynccontextmanager
async def open_call_scope(record: AccessRecord) -> AsyncIterator[CallScope]:
    """Run the body as one call: tasks started in the scope's nursery and the
    ``on_request_end`` callbacks registered within belong to it.

    On exit the nursery is cancelled (the body is done, so whatever still runs
    there is a helper that has no one to serve), then every cleanup runs - each
    whatever the others do - and the access line is written."""
    scope: CallScope | None = None
    try:
        async with trio.open_nursery() as nursery:
            scope = CallScope(nursery, record)
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
                log.exception("request cleanup failed")
        access_log.write(record)


def current_scope() -> CallScope:
    scope = _current.get()
    if scope is None:
        raise RuntimeError("not within an API call (open_call_scope)")
    return scope


def request_nursery() -> trio.Nursery:
    """A nursery that lives as long as this call: it is cancelled when the
    response has been sent or the client went away."""
    return current_scope().nursery


def on_request_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the call ends, however it ends (even if a
    streaming body was never started)."""
    current_scope().cleanups.append(callback)


def access_record() -> AccessRecord:
    """This call's access-log record (routes fill in what they know); a
    throwaway one outside any call."""
    scope = _current.get()
    return scope.record if scope is not None else AccessRecord("?", "?")


def resolve_engine(model: str) -> Engine:
    try:
        engine = services().registry.resolve(model)
    except UnknownModel as exc:
        raise not_found(str(exc)) from None
    access_record().model = engine.name
    if engine.state is EngineState.LOADING:
        raise unavailable(f"Model {engine.name!r} is still loading; retry shortly")
    if engine.state is EngineState.RESTARTING:
        raise unavailable(f"Model {engine.name!r} is restarting after an engine failure; retry")
    if engine.state is not EngineState.READY:  # why is in the log and /health
        raise ApiError(
            503, f"Model {engine.name!r} is not serving ({engine.state.value})", "server_error"
        )
    return engine
