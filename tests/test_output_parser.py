"""Unit tests of the streaming output parser with scripted text deltas."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxtrio.chat.output import OutputParser, Segment
from mlxtrio.settings import EMBEDDED_MODEL_PATH

from .scripted_families import CALLS, FAMILIES, TEXT


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Path(EMBEDDED_MODEL_PATH))


def run(parser: OutputParser, deltas: list[str]) -> list[Segment]:
    out: list[Segment] = []
    for delta in deltas:
        out.extend(parser.feed(delta))
    out.extend(parser.finish())
    return out


def merged(segments: list[Segment]) -> list[tuple[str, str]]:
    """Adjacent segments of one kind joined; tool calls as their JSON."""
    result: list[tuple[str, str]] = []
    for s in segments:
        text = (
            s.text
            if s.tool_call is None
            else json.dumps([s.tool_call.name, json.loads(s.tool_call.arguments)])
        )
        if result and result[-1][0] == s.kind and s.kind != "tool_call":
            result[-1] = (s.kind, result[-1][1] + text)
        else:
            result.append((s.kind, text))
    return result


def test_plain_text_passes_through(tokenizer) -> None:
    assert merged(run(OutputParser(tokenizer), ["Hel", "lo", " world", "."])) == [
        ("text", "Hello world.")
    ]


def test_reasoning_then_text_with_markers_split_across_deltas(tokenizer) -> None:
    parser = OutputParser(tokenizer, starts_in_reasoning=True)
    segments = run(parser, ["\nI should", " greet.\n</th", "ink>\n\n", "Hi", " there"])
    assert merged(segments) == [("reasoning", "I should greet."), ("text", "Hi there")]


def test_tool_call_is_parsed_and_markup_never_leaks(tokenizer) -> None:
    deltas = [
        "Let me check.\n",
        "<tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}',
        "</tool_call>",
    ]
    segments = run(OutputParser(tokenizer), deltas)
    assert merged(segments) == [
        ("text", "Let me check."),
        ("tool_call", '["get_weather", {"city": "Paris"}]'),
    ]
    assert all("<" not in s.text for s in segments)


def test_two_tool_calls_and_whitespace_between(tokenizer) -> None:
    deltas = [
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    ]
    assert merged(run(OutputParser(tokenizer), deltas)) == [
        ("tool_call", '["a", {}]'),
        ("tool_call", '["b", {"x": 1}]'),
    ]


def test_invalid_tool_call_is_dropped_and_counted(tokenizer) -> None:
    parser = OutputParser(tokenizer)
    assert merged(run(parser, ["<tool_call>{not json</tool_call>", "ok"])) == [("text", "ok")]
    assert parser.invalid_tool_calls == 1


def test_unterminated_tool_call_is_salvaged_at_finish(tokenizer) -> None:
    segments = run(OutputParser(tokenizer), ['<tool_call>{"name": "a", "arguments": {"k": "v"}}'])
    assert merged(segments) == [("tool_call", '["a", {"k": "v"}]')]


def test_held_back_prefix_is_flushed_when_it_was_not_a_marker(tokenizer) -> None:
    assert merged(run(OutputParser(tokenizer), ["a <tool", " b"])) == [("text", "a <tool b")]


def test_every_call_a_family_parser_returns_is_kept(tokenizer) -> None:
    """mistral (like kimi_k2, gemma4, minimax_m2) returns several calls for one
    segment; each becomes its own tool call, in order."""
    from mlx_lm.tool_parsers import mistral

    from mlxtrio.chat.output import parse_tool_calls

    class Mistral:  # the embedded tokenizer, speaking mistral's call format
        tool_parser = staticmethod(mistral.parse_tool_call)

    raw = 'get_weather[ARGS]{"city": "Paris"}get_time[ARGS]{"zone": "UTC"}'
    calls = parse_tool_calls(Mistral(), raw, None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    listed = json.dumps([{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{}"}])
    assert [c.name for c in parse_tool_calls(Mistral(), listed, None)] == ["a", "b"]
    assert parse_tool_calls(Mistral(), "not a call", None) == []


def test_closing_markers_of_blocks_never_opened_are_not_shown(tokenizer) -> None:
    """A small model on an agent's prompt may write ``</think>`` or
    ``</tool_call>`` without the opening marker: markup is never answer text."""
    parser = OutputParser(tokenizer, starts_in_reasoning=False)
    out = run(parser, ["Of people so", " learning.\n</th", "ink>", " Done.</tool_", "call>"])
    assert merged(out) == [("text", "Of people so learning.\n Done.")]
    # Inside reasoning, </think> still closes the block.
    parser = OutputParser(tokenizer, starts_in_reasoning=True)
    out = run(parser, ["hm", "</think>", "\n\nAnswer."])
    assert merged(out) == [("reasoning", "hm"), ("text", "Answer.")]


def family_tokenizer(family: str, response_format: dict | None = None) -> TokenizerWrapper:
    """The embedded tokenizer, speaking ``family``'s tool-call markup (markers
    are matched on text, so they need not be tokens here)."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    return TokenizerWrapper(
        load_tokenizer(Path(EMBEDDED_MODEL_PATH))._tokenizer,
        tool_parser=module.parse_tool_call,
        tool_call_start=module.tool_call_start,
        tool_call_end=module.tool_call_end,
        response_format=response_format,
    )


def test_every_mlx_lm_family_has_a_scripted_model() -> None:
    """A family mlx-lm adds must get a scripted model (tests/scripted_families.py)."""
    import mlx_lm.tool_parsers

    shipped = {m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    assert shipped == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_streamed_a_character_at_a_time(family: str) -> None:
    """Two calls in one turn in each family's markup, fed one character at a
    time (every marker split across deltas): the text before them and both
    calls come out, and no markup does."""
    markup = TEXT + "".join(FAMILIES[family].calls)
    segments = run(OutputParser(family_tokenizer(family)), list(markup))
    assert merged(segments) == [
        ("text", TEXT),
        *(("tool_call", json.dumps([name, args])) for name, args in CALLS),
    ]


def test_response_format_headers_are_not_text() -> None:
    """Muse Spark's response format starts in a message header and names each
    message's channel there: headers are dropped, as mlx-lm's server drops them."""
    from mlx_lm.chat_templates.muse_spark import RESPONSE_FORMAT

    call = FAMILIES["muse_spark"].calls
    deltas = [
        "to=self<|mess",
        "age|>Thinking.<|eom|>",
        "<|start|>assistant to=get_weather<|message|>",
        *call,
        "<|eom|><|start|>assistant to=user<|message|>",
        "Done.",
        "<|eot|>",
    ]
    segments = run(OutputParser(family_tokenizer("muse_spark", RESPONSE_FORMAT)), deltas)
    assert merged(segments) == [
        ("reasoning", "Thinking."),
        *(("tool_call", json.dumps([name, args])) for name, args in CALLS),
        ("text", "Done."),
    ]
