"""What a Harmony model (gpt-oss) may write after each ``<|channel|>``.

Harmony's markers are special tokens, so one grammar, armed at every
``<|channel|>`` token, holds each message's header and, for a call, its
body (see :mod:`mlxtrio.engine.harmony` for the format):

* ``analysis<|message|>`` - reasoning, free text up to ``<|end|>``;
* ``final<|message|>`` - the answer (free, or one JSON value matching the
  requested schema, then the end of the turn, for structured output);
* ``commentary<|message|>`` - a preamble, free text;
* ``commentary to=functions.NAME [<|constrain|>]json<|message|>{ARGS}<|call|>``
  - a call naming an offered tool, its arguments held to that tool's JSON
  Schema.

With no tools, no call can come. The grammar is complete at the end of a
header (free text follows) or at the end of a call, and is armed again at the
next ``<|channel|>``. When the turn must end in a call (``tool_choice``
required) or in a JSON answer (structured output), one grammar holds the
whole turn from its first token instead (:func:`turn_grammar`).
"""

from __future__ import annotations

from typing import Any

from .build import ToolGrammar, json_value, literal, token

# Reasoning before a required call or a structured answer is bounded: the
# grammar holds the whole turn from its first token then.
REASONING_CHARS = 1024


def channel_grammar(ids: dict[str, int], tools: list[ToolGrammar]) -> str:
    """The grammar after one ``<|channel|>`` for a Harmony model whose
    markers have ``ids``, when the model may answer or call as it likes:
    ``tools`` are the tools a call may name (none: no call)."""
    message = token(ids["<|message|>"])
    choices = ["analysis", "final", "preamble"]
    rules = [
        _ctype(ids),
        f'analysis: "analysis" {message}',
        f'final: "final" ctype? {message}',
        f'preamble: "commentary" {message}',
    ]
    if tools:
        rules += _calls(ids, tools)
        choices.append("call")
    return "\n".join([f"start: {' | '.join(choices)}", *rules])


def turn_grammar(
    ids: dict[str, int],
    tools: list[ToolGrammar],
    *,
    required: bool,
    output: tuple[dict[str, Any] | None, bool] | None,
) -> str:
    """The whole turn, from its first token, when it must end in a call
    (``required``) or in a JSON answer (``output``: schema, strict): at most
    one reasoning message of :data:`REASONING_CHARS` characters, then the
    call or the answer (a call naming one of ``tools`` may come instead of a
    structured answer)."""
    channel, message = token(ids["<|channel|>"]), token(ids["<|message|>"])
    rules = [
        _ctype(ids),
        f'thought: "analysis" {message} REASONING {token(ids["<|end|>"])} '
        f'{token(ids["<|start|>"])} "assistant" {channel}',
        f"REASONING: /(?s:.{{0,{REASONING_CHARS}}})/",
    ]
    last = []
    if tools:
        rules += _calls(ids, tools)
        last.append("call")
    if not required and output is not None:
        schema, strict = output
        ends = [token(ids[m]) for m in ("<|return|>", "<|end|>") if m in ids]
        value = json_value(schema if schema is not None else {"type": "object"}, strict)
        rules.append(f'final: "final" ctype? {message} {value} ({" | ".join(ends)})')
        last.append("final")
    return "\n".join([f"start: {channel} thought? ({' | '.join(last)})", *rules])


def _ctype(ids: dict[str, int]) -> str:
    """The header's content type: `` json`` or `` <|constrain|>json``."""
    constrain = f"{token(ids['<|constrain|>'])}?" if "<|constrain|>" in ids else ""
    return f'ctype: " " {constrain} "json"'


def _calls(ids: dict[str, int], tools: list[ToolGrammar]) -> list[str]:
    """``call``: the recipient naming one of ``tools``, its header's end, its
    arguments matching its schema, then ``<|call|>``."""
    message, end = token(ids["<|message|>"]), token(ids["<|call|>"])
    rules = [
        f"call{i}: {literal(tool.name)} ctype? {message} {json_value(tool.schema, tool.strict)} {end}"
        for i, tool in enumerate(tools)
    ]
    names = " | ".join(f"call{i}" for i in range(len(tools)))
    return [*rules, f'call: "commentary to=functions." ({names})']
