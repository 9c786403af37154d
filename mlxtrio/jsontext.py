"""Parsing JSON text that came from outside the process (a client's tool-call
arguments, a model's output) without any way to blow up.

``json.loads`` raises ``RecursionError`` on deeply nested input and a plain
``ValueError`` on integers beyond Python's conversion limit; both escaped the
``JSONDecodeError`` handlers around it as 500s. pydantic-core's parser (jiter)
bounds the nesting depth and reports every problem as one ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import pydantic_core


def loads(text: str | bytes) -> Any:
    """The JSON value of ``text``. Raises ``ValueError`` (only) if it is not
    JSON, is nested too deeply, holds an unrepresentable number or a lone
    surrogate, or uses NaN/Infinity."""
    return pydantic_core.from_json(text, allow_inf_nan=False)
