"""Transport concerns shared by every route: CORS, API keys, JSON bodies, and
turning any error into a JSON response in the right envelope (never a stack
trace, never a 500 for a client's mistake)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from .errors import ApiError, Surface

log = logging.getLogger("mlxtrio.http")

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
    "Access-Control-Allow-Headers": (
        "Content-Type, Authorization, x-api-key, anthropic-version, anthropic-beta, "
        "openai-organization, openai-project"
    ),
    "Access-Control-Max-Age": "600",
}

# Reachable without an API key: liveness probes and Claude Code's HEAD / warm-up.
OPEN_PATHS = frozenset({"/", "/health", "/v1/health"})


def error_response(error: ApiError, path: str | None = None) -> Response:
    surface = Surface.for_path(path if path is not None else request.path)
    response = Response(error.body(surface), status=error.status, content_type="application/json")
    for name, value in (error.headers or {}).items():
        response.headers[name] = value
    if error.status == 429 and surface is Surface.ANTHROPIC:
        response.headers["retry-after"] = (error.headers or {}).get("Retry-After", "1")
    return response


async def read_json_body() -> Any:
    """The request body as JSON, or a 400/413 ApiError."""
    try:
        raw = await request.get_data(cache=True)
    except HTTPException as exc:
        if exc.code == 413:
            raise too_large() from None
        raise
    if not raw:
        raise ApiError(400, "Request body is empty; send a JSON object", param="body")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"Invalid JSON in request body: {exc}", param="body") from None


def too_large() -> ApiError:
    limit = request.max_content_length or 0
    return ApiError(413, f"Request body too large (limit {limit} bytes)", "invalid_request_error")


def _check_api_key(keys: list[str]) -> str:
    """The key the request carries; raises a 401 ApiError."""
    supplied = request.headers.get("x-api-key")
    if supplied is None:
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        supplied = token.strip() if scheme.lower() == "bearer" else None
    if supplied is None:
        raise ApiError(
            401,
            "Missing API key: send it in x-api-key or Authorization: Bearer",
            "authentication_error",
        )
    # Compare with every key, so the time taken does not tell which one matched.
    matches = [hmac.compare_digest(supplied.encode(), key.encode()) for key in keys]
    if not any(matches):
        raise ApiError(401, "Invalid API key", "authentication_error")
    return keys[matches.index(True)]


def client_domain() -> str:
    """The authenticated client's isolation domain: with several API keys
    configured, a digest of the key (stable across restarts and reorderings,
    never the key itself), else "". Cached prefixes are shared and stored
    responses are visible only within a domain."""
    return str(g.get("client_domain", ""))


def install(app: Quart, api_key: str) -> None:
    """Register the hooks and error handlers on ``app``. ``api_key``: none, one
    key, or several separated by commas (each its own cache isolation domain)."""
    keys = [k.strip() for k in api_key.split(",") if k.strip()]
    # Computed once, not per request.
    domains = {k: "key:" + hashlib.sha256(k.encode()).hexdigest()[:24] for k in keys}

    @app.before_request
    async def _preflight_and_auth() -> Response | None:
        if request.method == "OPTIONS":
            return Response(b"", status=204, headers=CORS_HEADERS)
        if request.content_length is not None and request.max_content_length is not None:
            if request.content_length > request.max_content_length:
                return error_response(too_large())
        if keys and request.path not in OPEN_PATHS:
            key = _check_api_key(keys)
            if len(keys) > 1:
                g.client_domain = domains[key]
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        for name, value in CORS_HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    @app.errorhandler(ApiError)
    async def _api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        if status == 404:
            api_error = ApiError(
                404, f"No route matches {request.method} {request.path}", "not_found_error"
            )
        elif status == 405:
            allowed = sorted(getattr(error, "valid_methods", None) or [])
            api_error = ApiError(
                405,
                f"Method {request.method} not allowed on {request.path}; use {', '.join(allowed)}",
                headers={"Allow": ", ".join(allowed)},
            )
        elif status == 413:
            api_error = too_large()
        else:
            api_error = ApiError(status, error.description or error.name, "invalid_request_error")
        return error_response(api_error)

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "Internal server error", "server_error"))
