"""Request bodies -> validated models, and every validation failure -> a 400.

A client reads the first problem only, so one error is reported: ``param`` is its
dotted location (``messages.0.content``, ``temperature``) and the message names
the field and says what it must be, in words (the Anthropic envelope has no
``param``, so the location is always in the message too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from ..chat.errors import ConversationError
from ..http.errors import ApiError, invalid_request
from .fields import EXPECTED, INVALID, is_variant, variant_key, variant_values

Model = TypeVar("Model", bound=BaseModel)

# What a value must be, by pydantic error type (for errors our models do not word).
_PHRASES = {
    "string_type": "a string",
    "string_too_short": "a non-empty string",
    "bool_type": "a boolean (true or false)",
    "int_type": "an integer",
    "float_type": "a number",
    "finite_number": "a finite number",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "union_tag_not_found": "an object",
    "list_type": "an array",
    "too_short": "a non-empty array",
}


def parse(model: type[Model], body: Any) -> Model:
    """``body`` (decoded JSON) as ``model``, or a 400 naming the first problem."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise describe(exc.errors(include_url=False)[0]) from None


@contextmanager
def conversation_errors() -> Iterator[None]:
    """Report a :class:`ConversationError` from ``chat/`` as a 400."""
    try:
        yield
    except ConversationError as exc:
        raise invalid_request(exc.message, exc.param) from None


def describe(error: ErrorDetails) -> ApiError:
    """One pydantic error as a 400 a person can act on."""
    path = ".".join(str(s) for s in error["loc"] if not is_variant(s))
    kind, value = error["type"], error.get("input")
    if not path:
        return invalid_request("Request body must be a JSON object", "body")
    if kind == "missing":
        return invalid_request(f"Missing required field: {path}", path)
    if kind == INVALID:
        return invalid_request(error["msg"], path)
    if kind == "union_tag_invalid":
        return _unsupported(path, error)
    if kind == EXPECTED:
        phrase: str | None = error["msg"]
    elif kind == "literal_error":
        phrase = f"one of {error.get('ctx', {}).get('expected')}"
    else:
        phrase = _PHRASES.get(kind)
    if phrase is None:  # a check this module has no words for: pydantic's own
        return invalid_request(f'Field "{path}" is invalid: {error["msg"]}', path)
    return invalid_request(f'Field "{path}" must be {phrase} (got {_shown(value)})', path)


def _unsupported(path: str, error: ErrorDetails) -> ApiError:
    """A tagged union met a tag it has no member for (e.g. a block type)."""
    ctx = error.get("ctx", {})
    key = variant_key(str(ctx.get("tag", "")))
    field = f"{path}.{key}"
    given = error.get("input")
    if not isinstance(given, dict) or key not in given:
        return invalid_request(f"Missing required field: {field}", field)
    values = [f'"{v}"' for v in variant_values(str(ctx.get("expected_tags", "")))]
    expected = values[0] if len(values) == 1 else "one of " + ", ".join(values)
    return invalid_request(
        f"Unsupported {key} {_shown(given[key])} at {field}; expected {expected}", field
    )


def _shown(value: Any) -> str:
    """A short rendering of what the client sent (never the whole of it)."""
    if isinstance(value, dict):
        return "an object" if value else "an empty object"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    if isinstance(value, int) and value.bit_length() > 128:
        return "a very large integer"
    if isinstance(value, str) and len(value) > 40:
        value = value[:40]  # before quoting: a value may be megabytes long
    text = json.dumps(value)  # ASCII-only: safe for any string, lone surrogates too
    return text if len(text) <= 40 else text[:37] + "..."
