"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served models and aliases,
with the limits clients size their requests by.

One body answers every client that reads it:

* OpenAI's list shape (``object``, ``data`` of ``{id, object, created,
  owned_by}``) for the openai SDK and OpenAI-compatible tools;
* Anthropic's (``data`` of ``{type, id, display_name, created_at}``,
  ``has_more``, ``first_id``, ``last_id``; ``limit``, ``after_id`` and
  ``before_id`` page it) for the anthropic SDK and Claude Code;
* each entry's limits: ``context_window`` and ``max_output_tokens``, under
  Anthropic's names too (``max_input_tokens`` is the context window,
  ``max_tokens`` the output cap);
* and, when the request carries ``client_version`` (Codex appends it to its
  ``model_catalog_url``), Codex's catalog under ``models``: a ``ModelInfo``
  per name with ``context_window``, reasoning levels and modalities, so Codex
  neither falls back to its default metadata (and warns) nor guesses a
  272k-token window.

Limits come from the model (``max_position_embeddings``, or the server's
``CONTEXT_LENGTH`` when smaller) and ``MAX_OUTPUT_TOKENS``. Every servable
model is listed with its ``state`` (``available``, ``loading``, ``loaded``),
its weights' ``size_bytes`` on disk and its ``family``; ``POST /v1/models/load``
and ``/v1/models/unload`` (``{"model": ...}``) load and unload one.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from quart import Blueprint, Response, current_app, jsonify, request

from ..http.errors import ApiError, invalid_request
from ..http.transport import read_json_body
from ..serving.call import services
from ..serving.models import known
from ..serving.residency import Resident, UnknownModel

blueprint = Blueprint("models", __name__)

_STARTED = int(time.time())
_STARTED_AT = datetime.fromtimestamp(_STARTED, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
_MAX_LIMIT = 1000

# Codex's reasoning levels, as the chat template knows them: mlxtrio thinks
# unless ``reasoning.effort`` is "none" or "minimal".
_THINKING_LEVELS = [
    {"effort": "none", "description": "Answer at once, without a thinking segment"},
    {"effort": "medium", "description": "Think first (the model's <think> segment)"},
]


@blueprint.route("/v1/models", methods=["GET"])
async def list_models() -> Response:
    entries = _entries()
    page, has_more = _page(entries)
    body: dict[str, Any] = {
        "object": "list",
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
    if "client_version" in request.args:
        body["models"] = [_codex_model_info(entry, rank) for rank, entry in enumerate(entries)]
    return jsonify(body)


@blueprint.route("/v1/models/<path:model_id>", methods=["GET"])
async def retrieve_model(model_id: str) -> Response:
    resident = known(model_id)
    entry = _entry(model_id, resident)
    if model_id != resident.name:
        entry["alias_of"] = resident.name
    return jsonify(entry)


@blueprint.route("/v1/models/load", methods=["POST"])
async def load_model() -> Response:
    """Load a model now (scripts and tools: before the first request needs it).
    Answers once it is loaded, with its entry; 429 or 503 as a request would."""
    resident = known(_model_field(await read_json_body()))
    await services().models.load(resident)
    return jsonify(_entry(resident.name, resident))


@blueprint.route("/v1/models/unload", methods=["POST"])
async def unload_model() -> Response:
    """Unload a model now, freeing its memory (its disk KV tier stays). A
    model with requests in flight is not unloaded: 409."""
    resident = known(_model_field(await read_json_body()))
    if not resident.idle:
        raise ApiError(
            409,
            f"model {resident.name!r} is in use ({resident.users} request(s)); unload it "
            "once they are done",
            "invalid_request_error",
            param="model",
        )
    await services().models.unload(resident, "asked to")
    return jsonify(_entry(resident.name, resident))


def _model_field(body: Any) -> str:
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise invalid_request('the body must be a JSON object with a "model" string', "model")
    return model


def _entries() -> list[dict[str, Any]]:
    """One entry per served model, then one per alias that is not a pattern."""
    models = services().models
    entries = [_entry(resident.name, resident) for resident in models]
    for alias, target in models.aliases.items():
        if any(c in alias for c in "*?[") or alias in models.names():
            continue
        try:
            resident = models.resolve(alias)
        except UnknownModel:
            continue  # an alias of a model that is not served answers 404 anyway
        entries.append({**_entry(alias, resident), "alias_of": target})
    return entries


def _entry(name: str, resident: Resident) -> dict[str, Any]:
    context = _context(resident)
    output = min(services().settings.max_output_tokens, context) if context else None
    spec = resident.spec
    return {
        # OpenAI
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "mlxtrio",
        # Anthropic
        "type": "model",
        "display_name": name,
        "created_at": _STARTED_AT,
        "max_input_tokens": context,
        "max_tokens": output,
        # Both, by the names most OpenAI-compatible tools read
        "context_window": context,
        "max_output_tokens": output,
        # Models on demand
        "state": resident.state.value,
        "size_bytes": spec.size_bytes,
        "family": spec.family,
        "pinned": resident.pinned,
    }


def _context(resident: Resident) -> int | None:
    """The context served: the loaded model's, else what its config says,
    within the server's CONTEXT_LENGTH."""
    engine = resident.engine
    if engine is not None and engine.loaded is not None:
        return engine.context_length
    own = resident.spec.context
    limit = services().settings.context_length
    if own is None:
        return None
    return min(own, limit) if limit > 0 else own


def _page(entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Anthropic's paging: ``limit`` (1-1000, all by default), and ``after_id``
    or ``before_id`` naming the entry the page starts after or ends before.
    Returns the page and whether more entries lie beyond it (after it, or
    before it when paging back)."""
    args = request.args
    raw_limit = args.get("limit")
    limit = _MAX_LIMIT
    if raw_limit is not None:
        try:
            limit = int(raw_limit)
        except ValueError:
            raise invalid_request("limit must be an integer", "limit") from None
        if not 1 <= limit <= _MAX_LIMIT:
            raise invalid_request(f"limit must be within [1, {_MAX_LIMIT}]", "limit")
    ids = [entry["id"] for entry in entries]
    if (before := args.get("before_id")) is not None:
        end = ids.index(before) if before in ids else 0
        start = max(0, end - limit)
        return entries[start:end], start > 0
    start = 0
    if (after := args.get("after_id")) is not None:
        start = ids.index(after) + 1 if after in ids else len(ids)
    return entries[start : start + limit], start + limit < len(entries)


def _codex_model_info(entry: dict[str, Any], rank: int) -> dict[str, Any]:
    """Codex's ``ModelInfo`` (codex-rs ``openai_models.rs``) for one entry.

    Every field Codex 0.171 requires is here. Shell, patch, search and
    truncation fields copy Codex's fallback metadata (what it uses for a model
    it has no metadata for). ``base_instructions`` is required but stays empty:
    Codex then sends no ``instructions``, as with its fallback (its guidance
    goes into developer messages). Input is text, and images for a loaded
    vision-language model (Codex attaches ``-i`` images only to a model whose
    entry says it takes them)."""
    engine = services().models.resolve(entry["id"]).engine
    tokenizer = engine.tokenizer if engine is not None else None
    loaded = engine.loaded if engine is not None else None
    sees = loaded is not None and loaded.images is not None
    thinks = bool(getattr(tokenizer, "has_thinking", False))
    context = entry["context_window"]
    info: dict[str, Any] = {
        "slug": entry["id"],
        "display_name": entry["id"],
        "description": f"{entry.get('alias_of') or entry['id']} served by mlxtrio"
        + (f" ({context}-token context)" if context else ""),
        "default_reasoning_level": "medium" if thinks else None,
        "supported_reasoning_levels": _THINKING_LEVELS if thinks else [],
        "shell_type": "default",
        "visibility": "list",
        "supported_in_api": True,
        "priority": rank + 1,
        "upgrade": None,
        "base_instructions": "",
        "supports_reasoning_summaries": False,
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": None,
        "web_search_tool_type": "text",
        "truncation_policy": {"mode": "bytes", "limit": 10000},
        "supports_parallel_tool_calls": False,
        "supports_image_detail_original": False,
        "effective_context_window_percent": 95,
        "experimental_supported_tools": [],
        "input_modalities": ["text", "image"] if sees else ["text"],
        "prefer_websockets": _serves_responses_websocket(),
    }
    if context:
        info["context_window"] = context
        info["max_context_window"] = context
    return info


def _serves_responses_websocket() -> bool:
    """Whether ``/v1/responses`` also takes WebSocket connections (Codex's
    ``supports_websockets`` transport)."""
    return any(
        rule.rule == "/v1/responses" and getattr(rule, "websocket", False)
        for rule in current_app.url_map.iter_rules()
    )
