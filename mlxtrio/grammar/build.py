"""Grammars as text, in llguidance's Lark dialect: a tool call in its family's
markup, and structured output.

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


def _alternatives(rules: Iterable[str]) -> str:
    return "(" + " | ".join(rules) + ")"


def hermes_call(tools: list[ToolGrammar], end_token: int) -> str:
    """The body of a Hermes call (``json_tools`` family), after the
    ``<tool_call>`` marker up to and with its closing marker:
    ``{"name": "<tool>", "arguments": {...}}`` (Qwen, Hermes, the embedded
    model). Whitespace around the object is the model's (templates put a
    newline on each side)."""
    rules = [
        f"call{i}: "
        + literal('{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": ')
        + " "
        + json_value(tool.schema, tool.strict)
        + ' "}"'
        for i, tool in enumerate(tools)
    ]
    names = _alternatives(f"call{i}" for i in range(len(tools)))
    lines = [f"start: SPACE? {names} SPACE? {token(end_token)}", "SPACE: /[ \\n]{1,2}/", *rules]
    return "\n".join(lines)


def qwen3_coder_call(tools: list[ToolGrammar], end_token: int) -> str:
    """The body of a Qwen3-Coder call (``qwen3_coder`` family: Qwen3-Coder,
    Qwen3.5), after ``<tool_call>`` up to and with ``</tool_call>``::

        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>

    Parameters come in the schema's order, the required ones always, the
    others when the model writes them. A string value is raw text up to the
    first ``\n</parameter>\n``; other values are JSON matching their schema
    (the parser converts them by the schema's type)."""
    rules: list[str] = []
    for i, tool in enumerate(tools):
        params = []
        properties = tool.schema.get("properties")
        required = set(tool.schema.get("required") or ())
        # Each value is compiled on its own: it takes the definitions along.
        defs = {k: tool.schema[k] for k in ("$defs", "definitions") if k in tool.schema}
        if isinstance(properties, dict) and properties:
            for j, (key, sub) in enumerate(properties.items()):
                rules.append(
                    f"p{i}_{j}: "
                    + literal(f"<parameter={key}>\n")
                    + " "
                    + _xml_value({**sub, **defs} if isinstance(sub, dict) else sub, tool.strict)
                )
                params.append(f"p{i}_{j}" + ("" if key in required else "?"))
        elif not isinstance(properties, dict):  # any keys
            rules.append(f'p{i}_any: "<parameter=" /[^\\s<>]+/ ">\\n" text')
            params.append(f"p{i}_any*")
        rules.append(
            f"call{i}: "
            + literal(f"<function={tool.name}>\n")
            + (" " + " ".join(params) if params else "")
            + ' "</function>"'
        )
    names = _alternatives(f"call{i}" for i in range(len(tools)))
    head = [
        f'start: "\\n"? {names} "\\n"? {token(end_token)}',
        'text[suffix="\\n</parameter>\\n"]: /(?s:.*)/',
    ]
    return "\n".join(head + rules)


def _xml_value(schema: Any, strict: bool) -> str:
    """A parameter's value and its closing tag, in Qwen3-Coder's markup."""
    close = literal("\n</parameter>\n")
    if not isinstance(schema, dict):
        return "text"
    kind = schema.get("type")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return _alternatives(literal(v) for v in enum) + " " + close
    if kind in ("integer", "number", "boolean", "object", "array"):
        return json_value(schema, strict) + " " + close
    return "text"  # strings, and anything the parser keeps as text


# Call bodies by mlx-lm tool-parser module. Families not listed keep the
# opening constraint only (grammar/shapes.py): their arguments are not in
# a form the schema can be held to here (GLM's XML parameters, pythonic
# calls, Gemma's own notation) or their markup is not pinned down by the
# parser.
CALL_GRAMMARS = {"json_tools": hermes_call, "qwen3_coder": qwen3_coder_call}


def call_grammar(family: str, tools: list[ToolGrammar], end_token: int | None) -> str | None:
    """The grammar of one call's body in ``family``'s markup, or None when the
    family has none (or its closing marker is not one token)."""
    build = CALL_GRAMMARS.get(family)
    if build is None or end_token is None or not tools:
        return None
    return build(tools, end_token)


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
    end = " " + _alternatives(token(t) for t in eos) if eos else ""
    choices = "answer" if call_marker is None else f"answer | {token(call_marker)}"
    lines = [f"start: {'SPACE? ' if after_reasoning else ''}({choices})", f"answer: {value}{end}"]
    if after_reasoning:
        lines.append("SPACE: /[ \\n]{1,2}/")
    return "\n".join(lines)
