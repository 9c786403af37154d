"""The response store as the Responses routes reach it, and the errors a store
that is missing or failing becomes."""

from __future__ import annotations

import logging

from ...http.errors import ApiError
from ...serving.call import services
from ...store import ResponseStore, StoreError, StoreUnavailable

log = logging.getLogger("mlxtrio.responses")


def open_store(purpose: str, unconfigured: ApiError) -> ResponseStore:
    """The response store; ``unconfigured`` when the server has none, a 503
    when it has one that is not open (yet: it is retried in the background)."""
    svc = services()
    if svc.store is not None:
        return svc.store
    if svc.store_configured:
        raise ApiError(
            503,
            f"{purpose}: the response store is unavailable; retry later",
            "server_error",
            code="store_unavailable",
            headers={"Retry-After": "30"},
        )
    raise unconfigured


def store_failure(exc: StoreError, doing: str) -> ApiError:
    """A clear 503 for a store that failed a read or a delete: the message says
    what failed, never how (the details, password-free, go to the log). Only a
    store that is down or busy is worth a retry."""
    log.error("%s: %s (%s)", doing, exc, exc.detail)
    retry = isinstance(exc, StoreUnavailable)
    return ApiError(
        503,
        f"{doing[0].upper()}{doing[1:]}: {exc}" + ("; retry later" if retry else ""),
        "server_error",
        code="store_unavailable",
        headers={"Retry-After": "5"} if retry else None,
    )
