"""Grammars as text, in llguidance's Lark dialect: the pieces (a JSON value
held to a schema, literals, tokens) and structured output. A tool call's body
in each family's markup is built from them in :mod:`.calls`.

A JSON value inside a grammar is ``%json {schema}``. Every schema carries the
options it compiles with (``x-guidance``): JSON is written as chat templates
render it (``json.dumps``: ``", "`` and ``": "``, no other whitespace), which
is what models saw in training; free whitespace lets a small model loop on
blanks (measured: 200 tokens of spaces inside one call). And ``lenient`` for
schemas the client did not mark strict, so that a keyword the engine does not
implement is ignored rather than refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# How JSON is spelled inside constrained output.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Whatever JSON value a tool's arguments may be when its schema cannot be used.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolGrammar:
    """One offered tool as its calls must be written: its name, and the JSON
    Schema its arguments must match (``strict``: exactly, every keyword
    understood)."""

    name: str
    schema: dict[str, Any]
    strict: bool = False


def json_value(schema: dict[str, Any], strict: bool) -> str:
    """``%json {...}``: a JSON value matching ``schema`` (:func:`closed`)."""
    options = {**JSON_LAYOUT, "lenient": not strict}
    return "%json " + json.dumps({**closed(schema), "x-guidance": options}, ensure_ascii=False)


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords that bring in properties from elsewhere: an object with one of
# them beside its ``properties`` is left open (closing it would refuse those).
_COMPOSING_KEYS = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed(schema: Any, closable: bool = True) -> Any:
    """``schema`` with every object that lists its properties, and says
    nothing about others, closed to others (``additionalProperties: false``).

    JSON Schema lets such an object have any other key; a tool or a parser
    of structured output takes the keys it lists, and a small model left free
    invents more (measured: ``{"word": "", "lang": "en", "arguments": {...}}``
    for a two-key tool). An object whose properties are composed with others
    (``allOf``, ``anyOf``, ``$ref``, ...) stays open, and so do the branches
    composed with a parent's properties: closing either would refuse keys the
    other one lists."""
    if isinstance(schema, list):
        return [closed(item, closable) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    lists_properties = isinstance(out.get("properties"), dict)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = closed(out[key], closable=not lists_properties and key != "allOf")
    if isinstance(out.get("items"), dict | list):
        out["items"] = closed(out["items"])
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = closed(out["prefixItems"])
    composed = any(k in out for k in (*_OPEN_KEYS, *_COMPOSING_KEYS))
    if closable and lists_properties and not composed:
        out["additionalProperties"] = False
    return out


def literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def token(token_id: int) -> str:
    """A token of the vocabulary, by id (markers are special tokens)."""
    return f"<[{token_id}]>"


def alternatives(rules: Iterable[str]) -> str:
    """Any one of ``rules`` (grammar expressions)."""
    return "(" + " | ".join(rules) + ")"


def output_grammar(
    schema: dict[str, Any] | None,
    strict: bool,
    eos: list[int],
    call_marker: int | None,
    after_reasoning: bool = False,
) -> str:
    """Structured output: the answer is one JSON value matching ``schema``
    (any JSON object when None: ``json_object``), then the end of the turn
    (any of the ``eos`` tokens). With ``call_marker`` the model may open a
    tool call instead (its body is then held by the call grammar).
    ``after_reasoning``: it starts where reasoning closed, where templates put
    a blank line."""
    value = json_value(schema if schema is not None else ANY_OBJECT, strict)
    end = " " + alternatives(token(t) for t in eos) if eos else ""
    choices = "answer" if call_marker is None else f"answer | {token(call_marker)}"
    lines = [f"start: {'SPACE? ' if after_reasoning else ''}({choices})", f"answer: {value}{end}"]
    if after_reasoning:
        lines.append("SPACE: /[ \\n]{1,2}/")
    return "\n".join(lines)
