"""Field checks shared by both request mappers (JSON numbers, JS-style integers)."""

from __future__ import annotations

from typing import Any

from ..http.errors import invalid_request

MAX_INT32 = 2147483647


def is_int(value: Any) -> bool:
    """An integral JSON number: ``5`` and ``5.0`` yes, ``True`` and ``"5"`` no."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def number_in(
    body: dict[str, Any], name: str, low: float, high: float, param: str | None = None
) -> float | None:
    """``body[name]`` as a float within [low, high], None if absent; else a 400."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise invalid_request(
            f'Field "{name}" must be a number between {low:g} and {high:g}', param
        )
    return float(value)


def dict_field(body: dict[str, Any], name: str) -> dict[str, Any]:
    """``body[name]`` if it is an object, else ``{}`` (tolerant reads)."""
    value = body.get(name)
    return value if isinstance(value, dict) else {}


def list_field(body: dict[str, Any], name: str) -> list[Any]:
    """``body[name]`` if it is an array, else ``[]`` (tolerant reads)."""
    value = body.get(name)
    return value if isinstance(value, list) else []
