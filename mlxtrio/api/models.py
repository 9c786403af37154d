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

Limits come from the loaded model (``max_position_embeddings``, or the
server's ``CONTEXT_LENGTH`` when smaller) and its ``MAX_OUTPUT_TOKENS``; they are absent while a model is still loading.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from quart import Blueprint, Response, current_app, jsonify, request

from ..engine.engine import Engine
from ..engine.registry import UnknownModel
from ..http.errors import invalid_request, not_found
from ..serving.call import services

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
    registry = services().registry
    try:
        engine = registry.resolve(model_id)
    except UnknownModel as exc:
        raise not_found(str(exc)) from None
    entry = _entry(model_id, engine)
    if model_id != engine.name:
        entry["alias_of"] = engine.name
    return jsonify(entry)


def _entries() -> list[dict[str, Any]]:
    """One entry per served model, then one per alias that is not a pattern."""
    registry = services().registry
    entries = [_entry(engine.name, engine) for engine in registry]
    for alias, target in registry.aliases.items():
        if any(c in alias for c in "*?[") or alias in registry.names():
            continue
        try:
            engine = registry.resolve(alias)
        except UnknownModel:
            continue  # an alias of a model that is not served answers 404 anyway
        entries.append({**_entry(alias, engine), "alias_of": target})
    return entries


def _entry(name: str, engine: Engine) -> dict[str, Any]:
    context = engine.context_length if engine.loaded else None
    output = min(services().settings.max_output_tokens, context) if context else None
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
    }


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
    goes into developer messages). Input is text only: no model served here
    reads images."""
    registry = services().registry
    engine = registry.resolve(entry["id"])
    thinks = bool(getattr(engine.tokenizer, "has_thinking", False))
    context = entry["context_window"]
    info: dict[str, Any] = {
        "slug": entry["id"],
        "display_name": entry["id"],
        "description": f"{engine.name} served by mlxtrio"
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
        "input_modalities": ["text"],
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
