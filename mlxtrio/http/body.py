"""Reading a JSON request body safely.

Everything a client can put in a body is refused with a 4xx here rather than
reaching a parser that fails with a 500 or burns CPU:

* only JSON content types are read (415 otherwise): a browser page can send
  ``text/plain`` or an untyped body to 127.0.0.1 without a CORS preflight;
* the size is capped before the body is read (413);
* parsing uses pydantic-core's JSON parser (jiter), which bounds nesting depth,
  rejects numbers beyond what Python will convert, lone surrogates in strings
  (they cannot be encoded later) and NaN/Infinity.
"""

from __future__ import annotations

from typing import Any

from quart import request
from werkzeug.exceptions import HTTPException

from .. import jsontext
from .errors import ApiError

_JSON_TYPES = ("application/json",)


def is_json_content_type(value: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, any parameters."""
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    return mime in _JSON_TYPES or (mime.startswith("application/") and mime.endswith("+json"))


def too_large() -> ApiError:
    limit = request.max_content_length or 0
    return ApiError(413, f"Request body too large (limit {limit} bytes)", "invalid_request_error")


async def read_json_body() -> Any:
    """The request body as JSON, or a 400/413/415 :class:`ApiError`."""
    if not is_json_content_type(request.headers.get("Content-Type")):
        raise ApiError(
            415,
            "Unsupported Content-Type: send the body as JSON with 'Content-Type: application/json'",
            "invalid_request_error",
            param="Content-Type",
        )
    try:
        raw = await request.get_data(cache=True)
    except HTTPException as exc:
        if exc.code == 413:
            raise too_large() from None
        raise
    if not raw:
        raise ApiError(400, "Request body is empty; send a JSON object", param="body")
    try:
        return jsontext.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"Invalid JSON in request body: {exc}", param="body") from None
