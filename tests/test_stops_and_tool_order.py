"""Unit tests: stop sequences across deltas, tool-order validation."""

from __future__ import annotations

import pytest

from mlxtrio.chat.conversation import Message, ToolCall
from mlxtrio.chat.stops import StopScanner
from mlxtrio.chat.tool_order import ANTHROPIC, OPENAI, ToolOrderError, validate_tool_order


def scan(stops: list[str], deltas: list[str]) -> tuple[str, str | None]:
    scanner = StopScanner(stops)
    out = "".join(scanner.push(d) for d in deltas) + scanner.flush()
    return out, scanner.matched


def test_stop_across_delta_boundary() -> None:
    assert scan(["HALT"], ["abc HA", "LT rest"]) == ("abc ", "HALT")


def test_partial_that_is_not_a_stop_is_released() -> None:
    assert scan(["HALT"], ["abc HA", "M and more"]) == ("abc HAM and more", None)
    assert scan(["HALT"], ["ends with HAL"]) == ("ends with HAL", None)


def test_earliest_stop_wins_and_blank_stops_are_ignored() -> None:
    assert scan(["xyz", "b", "  ", ""], ["a", "bcxyz"]) == ("a", "b")


def test_no_stops_passes_through() -> None:
    assert scan([], ["a", "b"]) == ("ab", None)


def fanout(*ids: str) -> Message:
    return Message("assistant", tool_calls=[ToolCall(i, "f", {}) for i in ids])


def result(call_id: str) -> Message:
    return Message("tool", "out", tool_call_id=call_id)


def test_results_are_reordered_into_declared_order() -> None:
    messages = [
        Message("user", "q"),
        fanout("a", "b"),
        result("b"),
        result("a"),
        Message("user", "next"),
    ]
    validate_tool_order(messages, ANTHROPIC)
    assert [m.tool_call_id for m in messages[2:4]] == ["a", "b"]


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([Message("user", "q"), result("a")], "is not preceded by"),
        ([fanout("a", "a"), result("a")], 'duplicate tool_use_id "a"'),
        ([fanout(""), result("a")], "no id"),
        ([fanout("a"), result("zzz")], 'references tool_use_id "zzz"'),
        ([fanout("a", "b"), result("a"), result("a")], "duplicate tool message"),
        ([Message("user", "q"), fanout("a")], "trailing turn"),
        ([fanout("a"), Message("user", "q")], "declares 1 tool call but the next message"),
        ([fanout("a", "b"), result("a"), Message("user", "q")], "unresolved sibling tool calls: b"),
        ([fanout("a"), Message("tool", "x", tool_call_id="")], "missing tool_use_id"),
    ],
)
def test_tool_order_errors(messages: list[Message], fragment: str) -> None:
    with pytest.raises(ToolOrderError, match=fragment):
        validate_tool_order(messages, ANTHROPIC)


def test_openai_vocabulary() -> None:
    with pytest.raises(ToolOrderError, match="function_call_output"):
        validate_tool_order([Message("tool", "x", tool_call_id="c")], OPENAI)
