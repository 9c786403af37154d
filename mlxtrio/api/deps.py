"""What route handlers need from the app and the request scope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import trio
from quart import current_app, request

from ..engine.engine import Engine, EngineState
from ..engine.registry import UnknownModel
from ..http.access_log import AccessRecord, current_record
from ..http.errors import ApiError, not_found, unavailable
from ..services import Services

NURSERY_KEY = "mlxtrio.nursery"
CLEANUP_KEY = "mlxtrio.cleanup"


def services() -> Services:
    return cast(Services, current_app.extensions["mlxtrio"])


def request_nursery() -> trio.Nursery:
    """A nursery that lives as long as this request's connection handling: it is
    cancelled when the response has been sent or the client went away."""
    return cast(trio.Nursery, cast(dict[str, Any], request.scope)[NURSERY_KEY])


def on_request_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the request ends, however it ends (even if a
    streaming body was never started)."""
    cast(dict[str, Any], request.scope)[CLEANUP_KEY].append(callback)


def access_record() -> AccessRecord:
    """This request's access-log record (routes fill in what they know)."""
    return current_record(cast(dict[str, Any], request.scope))


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
