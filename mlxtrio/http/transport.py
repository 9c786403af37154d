"""Transport concerns shared by every route, installed on the app: the security
guards (:mod:`.security`), and turning any error into a JSON response in the
right envelope - never a stack trace, never a 5xx for a client's mistake."""

from __future__ import annotations

import logging
from typing import Any

from quart import Quart, Response, g, has_request_context, has_websocket_context, request
from quart import websocket as websocket_context
from werkzeug.exceptions import HTTPException

from .body import read_json_body, too_large
from .errors import ApiError, Envelope
from .security import ApiKeys, HostPolicy, OriginPolicy

log = logging.getLogger("mlxtrio.http")

# Reachable without an API key: liveness probes and Claude Code's HEAD / warm-up.
OPEN_PATHS = frozenset({"/", "/health", "/v1/health"})

__all__ = ["client_domain", "client_session", "error_response", "install", "read_json_body"]


def _current() -> tuple[str, str]:
    """(method, path) of the request or WebSocket being handled."""
    if has_request_context():
        return request.method, request.path
    if has_websocket_context():
        return "GET", websocket_context.path
    return "?", "/"


def error_response(error: ApiError, path: str | None = None) -> Response:
    envelope = Envelope.for_path(path if path is not None else _current()[1])
    response = Response(error.body(envelope), status=error.status, content_type="application/json")
    for name, value in (error.headers or {}).items():
        response.headers[name] = value
    if error.status == 429 and envelope is Envelope.ANTHROPIC:
        response.headers["retry-after"] = (error.headers or {}).get("Retry-After", "1")
    return response


def client_domain() -> str:
    """The authenticated client's isolation domain: with several API keys
    configured, a digest of the key (stable across restarts and reorderings,
    never the key itself), else "". Cached prefixes are shared and stored
    responses are visible only within a domain."""
    return str(g.get("client_domain", ""))


# Headers agent clients name their session by (Claude Code, Codex).
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id")


def client_session() -> str | None:
    """The session the client names in its headers, if any."""
    if has_request_context():
        headers = request.headers
    elif has_websocket_context():
        headers = websocket_context.headers
    else:
        return None
    return next((headers[name] for name in SESSION_HEADERS if headers.get(name)), None)


def install(app: Quart, api_key: str, cors_origins: str = "", allowed_hosts: str = "") -> None:
    """Register the guards and error handlers on ``app``. ``api_key``: none, one
    key, or several separated by commas (each its own isolation domain)."""
    keys = ApiKeys(api_key)
    origins = OriginPolicy.parse(cors_origins)
    hosts = HostPolicy.parse(allowed_hosts)
    # "/v1//responses" is a client bug to report, not a redirect to follow.
    app.url_map.merge_slashes = False

    def _foreign(headers: Any, scope: Any) -> ApiError | None:
        """A refusal for a foreign Host (DNS rebinding) or Origin, else None."""
        refusal = hosts.check(headers.get("Host"), scope.get("server"))
        origin = headers.get("Origin")
        if refusal is None and origin is not None and not origins.allows(origin):
            refusal = origins.refusal(origin)
        return refusal

    @app.before_request
    async def _guard() -> Response | None:
        refusal = _foreign(request.headers, request.scope)
        if refusal is not None:
            return error_response(refusal)
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS":
            allowed = (
                origins.preflight_headers(
                    origin, request.headers.get("Access-Control-Request-Headers")
                )
                if origin is not None
                else {}
            )
            return Response(b"", status=204, headers=allowed)
        if request.content_length is not None and request.max_content_length is not None:
            if request.content_length > request.max_content_length:
                return error_response(too_large())
        if keys and request.path not in OPEN_PATHS:
            g.client_domain = keys.authenticate(
                request.headers.get("x-api-key"), request.headers.get("Authorization")
            )
        return None

    @app.before_websocket
    async def _guard_websocket() -> Response | None:
        """The same host, origin and key checks as for requests, before the
        upgrade is accepted (a refusal is an HTTP answer to the handshake)."""
        ws = websocket_context
        refusal = _foreign(ws.headers, ws.scope)
        if refusal is not None:
            return error_response(refusal)
        if keys:
            try:
                g.client_domain = keys.authenticate(
                    ws.headers.get("x-api-key"), ws.headers.get("Authorization")
                )
            except ApiError as exc:
                return error_response(exc)
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin is not None and origins.allows(origin):
            for name, value in origins.headers(origin).items():
                response.headers.setdefault(name, value)
        return response

    @app.errorhandler(ApiError)
    async def _api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        return error_response(_from_http_exception(error))

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        method, path = _current()
        log.exception("unhandled error on %s %s", method, path)
        return error_response(ApiError(500, "Internal server error", "server_error"))


def _from_http_exception(error: HTTPException) -> ApiError:
    method, path = _current()
    status = error.code or 500
    if status == 404:
        return ApiError(404, f"No route matches {method} {path}", "not_found_error")
    if status == 405:
        allowed = sorted(getattr(error, "valid_methods", None) or [])
        return ApiError(
            405,
            f"Method {method} not allowed on {path}; use {', '.join(allowed)}",
            headers={"Allow": ", ".join(allowed)},
        )
    if status == 413:
        return too_large()
    if 300 <= status < 400:  # werkzeug's redirects (e.g. a missing trailing slash)
        return ApiError(404, f"No route matches {method} {path}", "not_found_error")
    return ApiError(status, error.description or error.name, "invalid_request_error")
