"""A tool call's body as a grammar, in each family's markup: what the model
writes after the family's start marker, up to and with what closes the call,
naming an offered tool and with arguments matching its JSON Schema.

One builder per mlx-lm tool-parser module (:data:`CALL_GRAMMARS`). Each writes
the markup the family's chat template renders and its parser reads; where a
family's parser turns a parameter's text into a value by the schema's type
(the XML-like families), strings are raw text and other values are JSON, as
the templates write them. Families not listed keep only their opening held
(:mod:`.shapes`); why, beside :data:`CALL_GRAMMARS`.

A markup piece that the model's vocabulary holds as one added token (``[ARGS]``,
``<arg_key>``, ``<|"|>``, ...) is written as that token: the grammar engine
never matches an added special token as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .build import ToolGrammar, alternatives, json_value, literal, token

_NEWLINE, _COMMA = '"\\n"', '", "'  # as grammar literals

# Calls one marker may hold where a family writes several after one (a
# section, a list): a model that keeps adding calls is made to close.
MAX_CALLS = 8


def _several(item: str, sep: str = "") -> str:
    """One to :data:`MAX_CALLS` ``item`` (grammar expressions), ``sep``
    between two."""
    return f"{item} ({sep} {item}".rstrip().replace("( ", "(") + f"){{0,{MAX_CALLS - 1}}}"


@dataclass(frozen=True)
class CallVocabulary:
    """What a call grammar needs of the model's vocabulary: ``end``, the token
    closing a call (its family's end marker, when one token); ``eos``, the
    tokens ending the turn (for families whose calls run to it); ``added``,
    the added tokens by text."""

    end: int | None
    eos: tuple[int, ...] = ()
    added: Mapping[str, int] = field(default_factory=dict)

    def piece(self, text: str) -> str:
        """Markup ``text``: its token when it is one added token, else text."""
        token_id = self.added.get(text)
        return token(token_id) if token_id is not None else literal(text)

    def text_until(self, rule: str, close: str) -> str:
        """Rule ``rule``: free text up to and with the markup ``close``."""
        if close in self.added:  # text lexemes never hold an added token
            return f"{rule}: /(?s:.*)/ {token(self.added[close])}"
        return f"{rule}[suffix={literal(close)}]: /(?s:.*)/"


def _calls(tools: list[ToolGrammar]) -> str:
    """Any one of the ``call{i}`` rules."""
    return alternatives(f"call{i}" for i in range(len(tools)))


@dataclass(frozen=True)
class _Param:
    key: str
    schema: Any  # with the tool's definitions, compiled on its own
    required: bool


def _params(tool: ToolGrammar) -> list[_Param] | None:
    """``tool``'s parameters in its schema's order, or None when the schema
    does not list them (any keys)."""
    properties = tool.schema.get("properties")
    if not isinstance(properties, dict):
        return None
    required = set(tool.schema.get("required") or ())
    defs = {k: tool.schema[k] for k in ("$defs", "definitions") if k in tool.schema}
    # A property's schema may be a boolean: true takes any value, false none
    # (so the property is never written).
    return [
        _Param(key, {**sub, **defs} if isinstance(sub, dict) else {}, key in required)
        for key, sub in properties.items()
        if sub is not False
    ]


def _in_order(names: list[tuple[str, bool]], sep: str) -> str:
    """The rules ``names`` (name, required) in their order, the required ones
    always, the others when the model writes them, ``sep`` (a grammar
    expression) between two of them: an expression, empty when none."""
    starts = []
    for i, (name, required) in enumerate(names):
        rest = [f"{sep} {n}" if r else f"({sep} {n})?" for n, r in names[i + 1 :]]
        starts.append(" ".join([name, *rest]))
        if required:  # none before it can be the first written
            return alternatives(starts)
    return f"{alternatives(starts)}?" if starts else ""


def _each(names: list[tuple[str, bool]]) -> str:
    """The rules ``names`` (name, required) in their order, nothing between
    them, the required ones always (each ends its own markup)."""
    return " ".join(name if required else f"{name}?" for name, required in names)


def _string_enum(schema: Any) -> list[str] | None:
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return enum
    return None


def _is_text(schema: Any) -> bool:
    """Whether the family's parser keeps the value as written: strings, and
    schemas that do not say (it tries JSON, then keeps the text)."""
    if not isinstance(schema, dict):
        return True
    return schema.get("type") not in ("integer", "number", "boolean", "object", "array")


def _tagged_value(
    schema: Any, strict: bool, close: str, text_rule: str, vocab: CallVocabulary
) -> str:
    """A parameter's value in an XML-like family, up to and with ``close``:
    one of a string enum's values, raw text (``text_rule``), or JSON."""
    enum = _string_enum(schema)
    if enum is not None:
        return alternatives(literal(v) for v in enum) + " " + vocab.piece(close)
    if _is_text(schema):
        return text_rule
    return json_value(schema, strict) + " " + vocab.piece(close)


# -- the families ------------------------------------------------------------


def hermes_call(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """``json_tools`` (Qwen, Hermes, the embedded model), after ``<tool_call>``:
    ``{"name": "<tool>", "arguments": {...}}`` and ``</tool_call>``.
    Whitespace around the object is the model's (templates put a newline on
    each side)."""
    if vocab.end is None:
        return None
    rules = [
        f"call{i}: "
        + literal('{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": ')
        + " "
        + json_value(tool.schema, tool.strict)
        + ' "}"'
        for i, tool in enumerate(tools)
    ]
    head = [f"start: SPACE? {_calls(tools)} SPACE? {token(vocab.end)}", "SPACE: /[ \\n]{1,2}/"]
    return "\n".join(head + rules)


def qwen3_coder_call(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """``qwen3_coder`` (Qwen3-Coder, Qwen3.5), after ``<tool_call>``::

        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>

    then ``</tool_call>``. A string value is raw text up to the first
    ``\\n</parameter>\\n``; other values are JSON (the parser converts them by
    the schema's type)."""
    if vocab.end is None:
        return None
    close = "\n</parameter>\n"
    rules = [f"text[suffix={literal(close)}]: /(?s:.*)/"]
    for i, tool in enumerate(tools):
        params = _params(tool)
        names = []
        for j, param in enumerate(params or ()):
            value = _tagged_value(param.schema, tool.strict, close, "text", vocab)
            rules.append(f"p{i}_{j}: {literal(f'<parameter={param.key}>' + chr(10))} {value}")
            names.append((f"p{i}_{j}", param.required))
        if params is None:
            rules.append(f'p{i}_any: "<parameter=" /[^\\s<>]+/ ">\\n" text')
            names.append((f"p{i}_any*", True))
        body = _each(names)
        rules.append(
            f"call{i}: {literal(f'<function={tool.name}>' + chr(10))} {body} " + '"</function>"'
        )
    head = f'start: "\\n"? {_calls(tools)} "\\n"? {token(vocab.end)}'
    return "\n".join([head, *rules])


def glm_call(
    key_tag: str, value_tag: str
) -> Callable[[list[ToolGrammar], CallVocabulary], str | None]:
    """GLM 4.5-4.7 (``glm47``) and LongCat, after the start marker:
    ``NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...`` and the end
    marker, with the newline GLM 4.5's template puts after the name and each
    tag allowed. String values are raw text, others JSON (``tojson``)."""

    def build(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
        if vocab.end is None:
            return None
        open_key, close_key = vocab.piece(f"<{key_tag}>"), vocab.piece(f"</{key_tag}>")
        open_value, close_value = f"<{value_tag}>", f"</{value_tag}>"
        rules = ['NL: "\\n"', vocab.text_until("text", close_value)]
        for i, tool in enumerate(tools):
            params = _params(tool)
            names = []
            for j, param in enumerate(params or ()):
                value = _tagged_value(param.schema, tool.strict, close_value, "text", vocab)
                rules.append(
                    f"p{i}_{j}: {open_key} {literal(param.key)} {close_key} NL? "
                    f"{vocab.piece(open_value)} {value} NL?"
                )
                names.append((f"p{i}_{j}", param.required))
            if params is None:
                rules.append(
                    f"p{i}_any: {open_key} /[^<>\\n]+/ {close_key} NL? {vocab.piece(open_value)} text NL?"
                )
                names.append((f"p{i}_any*", True))
            body = _each(names)
            rules.append(f"call{i}: {literal(tool.name)} NL? {body}")
        return "\n".join([f"start: {_calls(tools)} {token(vocab.end)}", *rules])

    return build


def minimax_call(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """``minimax_m2``, after ``<minimax:tool_call>``: one or more ::

        <invoke name="NAME">
        <parameter name="KEY">VALUE</parameter>
        </invoke>

    and ``</minimax:tool_call>``. String values are raw text, others JSON."""
    if vocab.end is None:
        return None
    close = "</parameter>"
    rules = [vocab.text_until("text", close)]
    for i, tool in enumerate(tools):
        params = _params(tool)
        names = []
        for j, param in enumerate(params or ()):
            value = _tagged_value(param.schema, tool.strict, close, "text", vocab)
            opening = literal(f'<parameter name="{param.key}">')
            rules.append(f'p{i}_{j}: {opening} {value} "\\n"')
            names.append((f"p{i}_{j}", param.required))
        if params is None:
            rules.append(f'p{i}_any: "<parameter name=\\"" /[^"<>\\n]+/ "\\">" text "\\n"')
            names.append((f"p{i}_any*", True))
        body = _each(names)
        opening = literal(f'<invoke name="{tool.name}">\n')
        rules.append(f'call{i}: {opening} {body} "</invoke>"')
    head = f'start: "\\n"? {_several(_calls(tools), _NEWLINE)} "\\n"? {token(vocab.end)}'
    return "\n".join([head, *rules])


def kimi_k2_call(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """``kimi_k2``, after ``<|tool_calls_section_begin|>``: one or more
    ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>``
    and ``<|tool_calls_section_end|>``."""
    if vocab.end is None:
        return None
    begin, arguments = (
        vocab.piece("<|tool_call_begin|>"),
        vocab.piece("<|tool_call_argument_begin|>"),
    )
    end_call = vocab.piece("<|tool_call_end|>")
    rules = [
        f"call{i}: {begin} {literal(f'functions.{tool.name}:')} /[0-9]{{1,4}}/ {arguments} "
        f"{json_value(tool.schema, tool.strict)} {end_call}"
        for i, tool in enumerate(tools)
    ]
    return "\n".join([f"start: {_several(_calls(tools))} {token(vocab.end)}", *rules])


def mistral_call(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """``mistral``, after ``[TOOL_CALLS]``: ``NAME[ARGS]{...}`` (v11+
    templates; more calls each after another ``[TOOL_CALLS]``) or a JSON
    list of ``{"name": ..., "arguments": {...}}`` (older ones); the calls
    run to the end of the turn (the family has no closing marker)."""
    if not vocab.eos:
        return None
    marker, args = vocab.piece("[TOOL_CALLS]"), vocab.piece("[ARGS]")
    objects = alternatives(f"obj{i}" for i in range(len(tools)))
    rules = [
        f"headed: {_several(_calls(tools), marker)}",
        f'listed: "[" {_several(objects, _COMMA)} "]"',
    ]
    for i, tool in enumerate(tools):
        value = json_value(tool.schema, tool.strict)
        rules.append(f"call{i}: {literal(tool.name)} {args} {value}")
        head = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
        rules.append(f'obj{i}: {literal(head)} {value} "}}"')
    ends = alternatives(token(t) for t in vocab.eos)
    return "\n".join([f'start: " "? (headed | listed) {ends}', *rules])


def gemma4_call(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """``gemma4``, after ``<|tool_call>``: ``call:NAME{KEY:VALUE,...}`` and
    ``<tool_call|>``, strings between ``<|"|>`` delimiters, numbers and
    booleans bare. Object and array values are written as JSON, which the
    parser reads too (Gemma's own notation for them, bare keys and delimited
    strings at every depth, is not held)."""
    if vocab.end is None:
        return None
    quote = '<|"|>'
    rules = [vocab.text_until("text", quote)]
    for i, tool in enumerate(tools):
        params = _params(tool)
        names = []
        for j, param in enumerate(params or ()):
            enum = _string_enum(param.schema)
            if enum is not None:
                value = f"{vocab.piece(quote)} {alternatives(literal(v) for v in enum)} {vocab.piece(quote)}"
            elif _is_text(param.schema):
                value = f"{vocab.piece(quote)} text"
            else:
                value = json_value(param.schema, tool.strict)
            rules.append(f"p{i}_{j}: {literal(param.key + ':')} {value}")
            names.append((f"p{i}_{j}", param.required))
        body = _in_order(names, '","') if params is not None else f'(any{i} ("," any{i})*)?'
        if params is None:
            rules.append(f'any{i}: /[A-Za-z_][A-Za-z0-9_]*/ ":" {vocab.piece(quote)} text')
        rules.append(f"call{i}: {literal(f'call:{tool.name}' + '{')} {body} " + '"}"')
    return "\n".join([f"start: {_calls(tools)} {token(vocab.end)}", *rules])


def pythonic_call(tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """``pythonic`` (LFM2, Llama 3.2 style), after ``<|tool_call_start|>``:
    ``[NAME(KEY=VALUE, ...), ...]`` and ``<|tool_call_end|>``. Values are
    JSON, which the parser reads as Python literals (``true``, ``false`` and
    ``null`` included)."""
    if vocab.end is None:
        return None
    rules = []
    for i, tool in enumerate(tools):
        params = _params(tool)
        names = []
        for j, param in enumerate(params or ()):
            rules.append(
                f"p{i}_{j}: {literal(param.key + '=')} {json_value(param.schema, tool.strict)}"
            )
            names.append((f"p{i}_{j}", param.required))
        if params is None:
            value = json_value({}, False)
            rules.append(f'any{i}: /[A-Za-z_][A-Za-z0-9_]*/ "=" {value}')
            body = f'(any{i} (", " any{i})*)?'
        else:
            body = _in_order(names, '", "')
        rules.append(f"call{i}: {literal(tool.name + '(')} {body} " + '")"')
    head = f'start: "[" {_several(_calls(tools), _COMMA)} "]" {token(vocab.end)}'
    return "\n".join([head, *rules])


# Call bodies by mlx-lm tool-parser module (laguna's parser is glm47's).
# Families left out keep their opening held (see .shapes), for these reasons:
# * function_gemma: its parser cuts a bare value at the first comma, so an
#   object or array argument cannot be written in a form it reads back;
# * kimi_k3 and muse_spark: their markup is not pinned down by the parser
#   (see .shapes);
# * minicpm5: its start marker ends inside a tag (``<function name=``), and
#   values may come wrapped in CDATA or not: left to a later change.
CALL_GRAMMARS: dict[str, Callable[[list[ToolGrammar], CallVocabulary], str | None]] = {
    "json_tools": hermes_call,
    "qwen3_coder": qwen3_coder_call,
    "glm47": glm_call("arg_key", "arg_value"),
    "longcat": glm_call("longcat_arg_key", "longcat_arg_value"),
    "minimax_m2": minimax_call,
    "kimi_k2": kimi_k2_call,
    "mistral": mistral_call,
    "gemma4": gemma4_call,
    "pythonic": pythonic_call,
}


def call_grammar(family: str, tools: list[ToolGrammar], vocab: CallVocabulary) -> str | None:
    """The grammar of one call's body in ``family``'s markup naming one of
    ``tools``, or None when the family has none (or what closes its calls is
    not one token)."""
    build = CALL_GRAMMARS.get(family)
    if build is None or not tools:
        return None
    return build(tools, vocab)
