"""Stored responses: retrieve (a running background response as it stands,
or its events again), cancel, delete, list input items.

A response is visible only within the client's isolation domain (its API
key); another domain's id answers 404, as if it did not exist.
"""

from __future__ import annotations

from quart import Blueprint, Response, jsonify, request

from ...http.errors import invalid_request, not_found
from ...http.transport import client_domain
from ...serving.call import services
from ...store import StoredResponse, StoreError
from . import background
from .objects import input_item_resources
from .storage import open_store, store_failure

blueprint = Blueprint("responses_stored", __name__)


async def _stored(response_id: str) -> StoredResponse:
    store = open_store(
        f"cannot read response {response_id!r}",
        not_found(f'Response "{response_id}" not found: no response store is configured'),
    )
    try:
        record = await store.get(response_id)
    except StoreError as exc:
        raise store_failure(exc, f"cannot read response {response_id!r}") from None
    if record is None or record.owner != client_domain():  # another key's: as if absent
        raise not_found(f'Response "{response_id}" not found or expired')
    return record


@blueprint.route("/v1/responses/<response_id>", methods=["GET"])
async def retrieve_response(response_id: str) -> Response:
    """The stored response; a running background response as it stands now,
    or, with ``stream=true``, its events after ``starting_after``."""
    job = background.live_job(response_id)
    if request.args.get("stream", "false").lower() == "true":
        if job is None:
            await _stored(response_id)  # 404 if it does not exist at all
            raise invalid_request(
                "only background responses can be streamed again, while the server "
                "still holds their events (for a while after they end)",
                "stream",
            )
        return background.follow_job(job, _starting_after(request.args.get("starting_after")))
    if job is not None:  # what it is now (its stored copy may lag or have failed)
        return jsonify(job.snapshot())
    return jsonify(background.orphaned((await _stored(response_id)).response))


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    try:
        return max(-1, int(value))
    except ValueError:
        raise invalid_request("starting_after must be an integer", "starting_after") from None


@blueprint.route("/v1/responses/<response_id>/cancel", methods=["POST"])
async def cancel_response(response_id: str) -> Response:
    job = background.live_job(response_id)
    stored = None if job is not None else (await _stored(response_id)).response
    return await background.cancel(response_id, stored)


@blueprint.route("/v1/responses/<response_id>", methods=["DELETE"])
async def delete_response(response_id: str) -> Response:
    await _stored(response_id)
    await background.delete_job(response_id)  # its last write must not bring it back
    store = services().store
    assert store is not None
    try:
        await store.delete(response_id)
    except StoreError as exc:
        raise store_failure(exc, f"cannot delete response {response_id!r}") from None
    return jsonify({"id": response_id, "object": "response.deleted", "deleted": True})


@blueprint.route("/v1/responses/<response_id>/input_items", methods=["GET"])
async def list_input_items(response_id: str) -> Response:
    record = await _stored(response_id)
    items = input_item_resources(list(record.input_items))
    if request.args.get("order", "desc") == "desc":
        items.reverse()
    after = request.args.get("after")
    if after:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    try:
        limit = max(1, min(100, int(request.args.get("limit", 20))))
    except ValueError:
        raise invalid_request("limit must be an integer between 1 and 100", "limit") from None
    page = items[:limit]
    return jsonify(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
