"""``GET /v1/models`` in the OpenAI list shape, aliases included."""

from __future__ import annotations

import time

from quart import Blueprint, Response, jsonify

from .deps import services

blueprint = Blueprint("models", __name__)

_STARTED = int(time.time())


@blueprint.route("/v1/models", methods=["GET"])
async def list_models() -> Response:
    registry = services().registry
    data = [
        {"id": name, "object": "model", "created": _STARTED, "owned_by": "mlxtrio"}
        for name in registry.names()
    ]
    for alias, target in registry.aliases.items():
        if not any(c in alias for c in "*?["):
            data.append(
                {
                    "id": alias,
                    "object": "model",
                    "created": _STARTED,
                    "owned_by": "mlxtrio",
                    "alias_of": target,
                }
            )
    return jsonify({"object": "list", "data": data})
