"""Scripted models (see ``tests/scripted_model.py``) for every tool-call family
mlx-lm 0.32 parses: each one's tokenizer names its family's parser and has its
markers as special tokens, and its script writes that family's markup.

Every family model answers the same prompts:

* tools offered -> ``Let me check.`` then two calls in one turn
  (:data:`CALLS`) in the family's markup, EOS;
* tools offered and ``TEXT`` in the last message -> ``Hello world.`` EOS (a
  turn that calls nothing unless the tool choice forces it);
* no tools and ``STRAY`` in the last message -> the two calls' markup straight
  away, or ``Hello world.`` when the tool-call marker is masked;
* otherwise -> ``Hello world.`` EOS.

A token has one successor, so a marker that recurs (the second call's opening)
is written inside a bigger piece (``</tool_call><tool_call>``): markers are
matched on text, so the parser sees the same markup. In the families with a
call grammar (``mlxtrio.grammar.calls``) the first call must end as the
grammar ends it (the closing marker's own token), so the second call opens
with a bigger piece (``\n<tool_call>``, which does not trigger the grammar)
and its closing marker is part of its last piece. The grammar engine takes an
added token that looks like a marker (``<...>``) for a special token, which
text never matches: no piece the grammar holds begins with ``<`` and ends
with ``>`` unless it is a marker. And where a grammar forces text, the
engine allows only the tokenizer's own spelling of it, so a held piece never
starts inside forced text and runs past its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .scripted_model import PLAIN, Script, write_model

TEXT = "Let me check."
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]

TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- set last = (messages[-1].content or '') if messages else '' -%}"
    "{%- if tools and 'TEXT' in last -%}{{- '<|s_plain|>' -}}"
    "{%- elif tools -%}{{- '<|s_tools2|>' -}}"
    "{%- elif 'STRAY' in last -%}{{- '<|s_stray|>' -}}"
    "{%- else -%}{{- '<|s_plain|>' -}}{%- endif -%}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class Family:
    """One family's markup for :data:`CALLS`: ``calls`` are the pieces from
    the start marker on; ``call`` is where the first call's own markup starts
    (the piece after the marker), for checking constrained openings."""

    parser: str  # the mlx-lm tool parser module (tokenizer_config tool_parser_type)
    markers: tuple[str, ...]
    calls: tuple[str, ...]

    @property
    def call(self) -> str:
        return self.calls[1]


def _glm_like(tag: str, key: str, value: str) -> tuple[str, ...]:
    """GLM 4.7 / LongCat: ``<tag>name<key>k</key><value>v</value></tag>``."""

    def call(name: str, arg: str, val: str) -> str:
        return f"{name}<{key}>{arg}</{key}><{value}>{val}</{value}>"

    # Held by the call grammar, as json_tools is.
    return (
        f"<{tag}>",
        call("get_weather", "city", "Paris"),
        f"</{tag}>",
        f"\n<{tag}>",
        call("get_time", "zone", "UTC") + f"</{tag}>",
    )


FAMILIES: dict[str, Family] = {
    "json_tools": Family(
        "json_tools",
        ("<tool_call>", "</tool_call>"),
        # The first call is held by the call grammar, which ends at the
        # closing marker token; the second opens with a piece that is not the
        # marker token, so it goes free and is parsed on text alone.
        (
            "<tool_call>",
            '{"name": "get_weather", "arguments": {"city": "Paris"}}',
            "</tool_call>",
            "\n<tool_call>",
            '{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
        ),
    ),
    "qwen3_coder": Family(
        "qwen3_coder",
        ("<tool_call>", "</tool_call>"),
        # Held by the call grammar, as json_tools is.
        (
            "<tool_call>",
            "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
            "</tool_call>",
            "\n<tool_call>",
            "\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
        ),
    ),
    "glm47": Family(
        "glm47", ("<tool_call>", "</tool_call>"), _glm_like("tool_call", "arg_key", "arg_value")
    ),
    "laguna": Family(
        "laguna", ("<tool_call>", "</tool_call>"), _glm_like("tool_call", "arg_key", "arg_value")
    ),
    "longcat": Family(
        "longcat",
        ("<longcat_tool_call>", "</longcat_tool_call>"),
        _glm_like("longcat_tool_call", "longcat_arg_key", "longcat_arg_value"),
    ),
    "kimi_k2": Family(
        "kimi_k2",
        (
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        # Held by the call grammar: one call per section (a second
        # <|tool_call_begin|> token would need a second successor), then
        # a second section in one free piece.
        (
            "<|tool_calls_section_begin|>",
            # Kimi's markers are tokens of their own, as in its vocabulary;
            # the grammar engine spells the text a grammar forces (here the
            # offered names' common start) as the tokenizer does: a piece.
            "<|tool_call_begin|>",
            "functions.get_",
            "weather:0",
            "<|tool_call_argument_begin|>",
            '{"city": "Paris"}',
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
            "\n<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:1"
            '<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|><|tool_calls_section_end|>',
        ),
    ),
    # The start marker is several tokens, and <|open|> opens every XTML block.
    "kimi_k3": Family(
        "kimi_k3",
        ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
        (
            "<|open|>",
            'tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>',
            '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
            "<|close|>call<|sep|>",
            '<|open|>call tool="get_time" index="2"<|sep|><|open|>argument key="zone" '
            'type="string"<|sep|>UTC<|close|>argument<|sep|><|close|>call<|sep|>',
            "<|close|>tools<|sep|>",
        ),
    ),
    # No end marker: the calls run to the end of the turn.
    "mistral": Family(
        "mistral",
        ("[TOOL_CALLS]",),
        # Held by the call grammar to the end of the turn, where a second
        # [TOOL_CALLS] token would need a second successor: the two calls in
        # the older templates' JSON list (name[ARGS]{...} is covered by
        # tests/test_call_grammars.py).
        (
            "[TOOL_CALLS]",
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        ),
    ),
    "pythonic": Family(
        "pythonic",
        ("<|tool_call_start|>", "<|tool_call_end|>"),
        (
            "<|tool_call_start|>",
            '[get_weather(city="Paris"), get_time(zone="UTC")]',
            "<|tool_call_end|>",
        ),
    ),
    "function_gemma": Family(
        "function_gemma",
        ("<start_function_call>", "<end_function_call>"),
        (
            "<start_function_call>",
            "call:get_weather{city:<escape>Paris<escape>}",
            "<end_function_call><start_function_call>",
            "call:get_time{zone:<escape>UTC<escape>}",
            "<end_function_call>",
        ),
    ),
    "gemma4": Family(
        "gemma4",
        ("<|tool_call>", "<tool_call|>"),
        (
            "<|tool_call>",
            'call:get_weather{city:<|"|>Paris<|"|>}',
            "<tool_call|>",
            "\n<|tool_call>",
            'call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>',
        ),
    ),
    "minimax_m2": Family(
        "minimax_m2",
        ("<minimax:tool_call>", "</minimax:tool_call>"),
        (
            "<minimax:tool_call>",
            '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>',
            '\n<invoke name="get_time">\n<parameter name="zone">UTC</parameter>\n</invoke>\n',
            "</minimax:tool_call>",
        ),
    ),
    # No wrapper: each call is one <function name="..."> block.
    "minicpm5": Family(
        "minicpm5",
        ("<function name=",),
        (
            "<function name=",
            '"get_weather"><param name="city">Paris</param>',
            "</function><function name=",
            '"get_time"><param name="zone">UTC</param>',
            "</function>",
        ),
    ),
    "muse_spark": Family(
        "muse_spark",
        ("<atem:function_calls>", "</atem:function_calls>"),
        (
            "<atem:function_calls>",
            '\n<atem:invoke name="get_weather"><atem:parameter name="city">Paris'
            "</atem:parameter></atem:invoke>",
            '\n<atem:invoke name="get_time"><atem:parameter name="zone">UTC'
            "</atem:parameter></atem:invoke>\n",
            "</atem:function_calls>",
        ),
    ),
}


def family_script(name: str) -> Script:
    """The :class:`Script` of family ``name``."""
    family = FAMILIES[name]
    return Script(
        TEMPLATE,
        {
            "<|s_plain|>": PLAIN,
            "<|s_tools2|>": [TEXT, *family.calls],
            "<|s_stray|>": list(family.calls),
        },
        fallbacks={"<|s_stray|>": PLAIN},
        markers=family.markers,
        tool_parser_type=family.parser,
    )


def build_family(out: Path, name: str) -> Path:
    """Write family ``name``'s scripted model to ``out`` and return it."""
    return write_model(out, family_script(name))
