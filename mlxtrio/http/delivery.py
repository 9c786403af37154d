"""Knowing whether a response reached its client.

A stored turn is written before its terminal event is sent (write-ahead, then
announce). If the client leaves before that event was handed to the transport,
it never saw the turn complete, and the record must not stay: the route takes
it back. :class:`~.sse.EventStream` tracks this for streams; :func:`tracked_json`
for a plain JSON body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quart import Response


class Delivery:
    """Set once the whole body was handed to the transport."""

    def __init__(self) -> None:
        self.delivered = False

    async def body(self, data: bytes) -> AsyncIterator[bytes]:
        yield data
        # Resumed only after the transport took the chunk; a client that left
        # while it was being written closes this generator at the yield instead.
        self.delivered = True


def tracked_json(payload: Any) -> tuple[Response, Delivery]:
    """A JSON response (with a Content-Length, as ``jsonify`` gives) whose
    delivery is tracked."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    delivery = Delivery()
    response = Response(delivery.body(data), status=200, content_type="application/json")
    response.headers["Content-Length"] = str(len(data))
    return response, delivery
