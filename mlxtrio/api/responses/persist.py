"""Persistence of Responses turns: write-ahead-then-announce, and taking back
what a client never saw.

A turn's record is committed before its terminal event (or JSON body) goes
out, so a client that continues the instant it sees ``response.completed``
always finds it. A store that cannot write within ``store_write_timeout`` is
logged and skipped: the client still gets its output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ...serving.call import on_call_end, services
from ...store import ResponseStore, StoredResponse, StoreError
from .items import InputItem
from .objects import ResponseObject, new_id
from .turn import Turn

log = logging.getLogger("mlxtrio.responses")


async def persist(turn: Turn, response: ResponseObject) -> bool:
    """Commit the turn before it is announced; never fail the client over it.
    Returns whether it was stored. A store that cannot write within
    ``store_write_timeout`` leaves nothing behind (the store guarantees it)."""
    svc = services()
    if svc.store is None or turn.request.store is False:
        return False
    record = record_of(turn, response)
    try:
        await svc.store.put(record, lock_wait=svc.settings.store_write_timeout)
    except StoreError as exc:
        log.error(
            "could not store response %s (the client still gets it): %s (%s)",
            response.id,
            exc,
            exc.detail,
        )
        return False
    return True


def record_of(turn: Turn, response: ResponseObject) -> StoredResponse:
    """The turn as the store keeps it (and as a WebSocket remembers it)."""
    svc = services()
    retention = turn.request.retention_seconds or svc.settings.response_retention
    return StoredResponse(
        id=response.id,
        previous_response_id=turn.request.previous_response_id,
        created_at=response.created_at,
        expires_at=int(time.time()) + retention,
        model=turn.request.model,
        status=response.status,
        instructions=turn.instructions,
        input_messages=[m.to_json() for m in turn.delta],
        input_items=input_items(turn.request.items),
        response=response.wire(),
        owner=turn.owner,
    )


def take_back_unless(delivered: Callable[[], bool], response_id: str) -> None:
    """When the call ends, delete the stored turn unless ``delivered()``: a
    client that left before the terminal event never saw the turn complete."""
    svc = services()  # the check runs after the call's context is gone
    store = svc.store
    assert store is not None

    def check() -> None:
        if not delivered():
            svc.spawn(_take_back, store, response_id)

    on_call_end(check)


async def _take_back(store: ResponseStore, response_id: str) -> None:
    try:
        if await store.discard(response_id):
            log.info("response %s was not delivered (the client left); not kept", response_id)
    except StoreError as exc:
        log.error("could not take back undelivered response %s: %s", response_id, exc.detail)


def input_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """The request's input items as the input_items endpoint lists them (with ids)."""
    out = []
    for model in items:
        item = model.wire()
        item.setdefault("type", "message")
        if item["type"] == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if item["type"] == "message":
            item.setdefault("status", "completed")
        item.setdefault("id", new_id("msg" if item["type"] == "message" else "item"))
        out.append(item)
    return out
