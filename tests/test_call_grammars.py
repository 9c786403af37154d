"""Each family's call grammar (``mlxtrio.grammar.calls``) against its own
markup: the body its chat template writes for a valid call is accepted to the
end, mlx-lm's parser for the family reads that body back as the same call,
and a body with arguments the schema refuses is cut at the first bad token.

Run on the embedded tokenizer twice: with the family's markup pieces as plain
text, and with them added as special tokens (as ``[ARGS]``, ``<arg_key>`` or
``<|"|>`` are in the families' real vocabularies), where the grammar must name
them as tokens.
"""

from __future__ import annotations

import importlib
from typing import Any

import llguidance
import llguidance.hf
import pytest

from mlxtrio.grammar.build import ToolGrammar
from mlxtrio.grammar.calls import CALL_GRAMMARS, MAX_CALLS, CallVocabulary, call_grammar
from mlxtrio.settings import EMBEDDED_MODEL_PATH

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Bergen"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "note": {"type": "string"},
    },
    "required": ["city", "days"],
}
TOOLS = [ToolGrammar("get_weather", CITY), ToolGrammar("get_time", {"type": "object"})]
CALL = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}

# Each family's body for CALL, as its template writes it (several where
# templates differ), and the same call with a city the schema refuses.
BODIES: dict[str, list[str]] = {
    "json_tools": ['\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n'],
    "qwen3_coder": [
        "\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n"
    ],
    "glm47": [
        "get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value>",
        # GLM 4.5's template: a newline after the name and each tag.
        "get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n",
    ],
    "longcat": [
        "get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Oslo"
        "</longcat_arg_value><longcat_arg_key>days</longcat_arg_key>"
        "<longcat_arg_value>3</longcat_arg_value>"
    ],
    "minimax_m2": [
        '\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n'
    ],
    "kimi_k2": [
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Oslo", "days": 3}<|tool_call_end|>'
    ],
    "mistral": [
        'get_weather[ARGS]{"city": "Oslo", "days": 3}',
        ' [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]',
    ],
    "gemma4": ['call:get_weather{city:<|"|>Oslo<|"|>,days:3}'],
    "pythonic": ['[get_weather(city="Oslo", days=3)]'],
}
# The pieces each family's real vocabulary holds as tokens of their own.
PIECES = {
    "glm47": ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "kimi_k2": ["<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
    "mistral": ["[ARGS]", "[TOOL_CALLS]"],
    "gemma4": ['<|"|>'],
}


def _tokenizer(special: list[str]) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL_PATH))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


class Family:
    """One family's grammar for TOOLS, on the embedded tokenizer (its
    closing marker: ``</tool_call>``; the turn's end: ``<|im_end|>``)."""

    def __init__(self, family: str, special: bool) -> None:
        self.family = family
        self.tokenizer = _tokenizer(PIECES.get(family, []) if special else [])
        self.end = self.tokenizer.convert_tokens_to_ids("</tool_call>")
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        added = dict(self.tokenizer.get_added_vocab()) if special else {}
        vocab = CallVocabulary(self.end, (self.eos,), added)
        text = call_grammar(family, TOOLS, vocab)
        assert text is not None
        self.grammar = llguidance.LLMatcher.grammar_from_lark(text)
        self.llg = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=len(self.tokenizer))

    def matcher(self) -> Any:
        matcher = llguidance.LLMatcher(self.llg, self.grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def tokens(self, body: str) -> list[int]:
        """``body`` and what closes it: the closing marker, or for a family
        without one nothing (the turn's end closes it: see :meth:`accepts`)."""
        ids = list(self.tokenizer.encode(body, add_special_tokens=False))
        return ids if self.family == "mistral" else [*ids, self.end]

    def accepts(self, body: str) -> bool:
        """The grammar takes ``body`` and its end, and is then complete (the
        matcher's ``try_consume_tokens`` never counts an EOS: it is given on
        its own)."""
        matcher, tokens = self.matcher(), self.tokens(body)
        if matcher.try_consume_tokens(tokens) < len(tokens):
            return False
        if self.family == "mistral" and not matcher.consume_token(self.eos):
            return False
        return bool(matcher.is_stopped())


CASES = [(f, s) for f in sorted(CALL_GRAMMARS) for s in ([False, True] if f in PIECES else [False])]


def test_every_family_has_bodies() -> None:
    assert set(BODIES) == set(CALL_GRAMMARS)


@pytest.mark.parametrize(("family", "special"), CASES)
def test_the_family_s_own_markup_is_accepted_and_parsed(family: str, special: bool) -> None:
    grammar = Family(family, special)
    parser = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    tools = [
        {"type": "function", "function": {"name": t.name, "parameters": t.schema}} for t in TOOLS
    ]
    for body in BODIES[family]:
        assert grammar.accepts(body), body
        parsed = parser.parse_tool_call(body.strip(), tools)
        parsed = parsed[0] if isinstance(parsed, list) else parsed
        assert {"name": parsed["name"], "arguments": parsed["arguments"]} == CALL, body


@pytest.mark.parametrize(("family", "special"), CASES)
def test_arguments_the_schema_refuses_are_cut(family: str, special: bool) -> None:
    grammar = Family(family, special)
    for body in BODIES[family]:
        for wrong in (body.replace("Oslo", "Paris"), body.replace("3", "12")):
            assert not grammar.accepts(wrong), wrong


def _series(family: str, count: int) -> str:
    """``count`` calls after one marker, as the family writes several."""
    one = BODIES[family][0]
    if family == "pythonic":
        return "[" + ", ".join([one[1:-1]] * count) + "]"
    if family == "minimax_m2":
        return "\n" + "\n".join([one.strip("\n")] * count) + "\n"
    if family == "mistral":
        return "[TOOL_CALLS]".join([one] * count)
    return one * count


@pytest.mark.parametrize("family", ["minimax_m2", "kimi_k2", "mistral", "pythonic"])
def test_calls_after_one_marker_are_bounded(family: str) -> None:
    """A family that writes several calls after one marker may write up to
    MAX_CALLS: a model that keeps adding calls is made to close."""
    grammar = Family(family, special=False)
    most, too_many = (
        grammar.tokens(_series(family, MAX_CALLS)),
        grammar.tokens(_series(family, MAX_CALLS + 1)),
    )
    assert grammar.matcher().try_consume_tokens(most) == len(most)
    assert grammar.matcher().try_consume_tokens(too_many) < len(too_many)


@pytest.mark.parametrize("family", sorted(CALL_GRAMMARS))
def test_boolean_property_schemas_build(family: str) -> None:
    """``{"x": true}`` (any value) and ``{"y": false}`` (never) are valid
    property schemas: every family builds a grammar that compiles."""
    schema = {"type": "object", "properties": {"x": True, "y": False}, "required": ["x"]}
    tokenizer = _tokenizer([])
    end = tokenizer.convert_tokens_to_ids("</tool_call>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = call_grammar(family, [ToolGrammar("f", schema)], CallVocabulary(end, (eos,), {}))
    assert text is not None
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()


@pytest.mark.parametrize(
    "family, body",
    [
        ("pythonic", '[get_time(zone="UTC", hour=3)]'),
        ("json_tools", '\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'),
        (
            "kimi_k2",
            '<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|>',
        ),
    ],
)
def test_a_tool_without_listed_properties_takes_any_keys(family: str, body: str) -> None:
    assert Family(family, special=False).accepts(body)
