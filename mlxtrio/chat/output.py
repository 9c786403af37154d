"""Streaming output parser: split generated text into reasoning, visible text and
tool calls, as it arrives.

Built on mlx-lm's ``TextStateMachine`` (which knows each model family's markers
through the ``TokenizerWrapper`` and holds back only what might be the start of a
marker) and the family's tool parser from ``mlx_lm.tool_parsers``: every family
mlx-lm parses works the same way here (``tests/test_tool_families.py`` runs each
one end to end). Markup never reaches the client: a tool-call segment is only
emitted once it is complete and parsed, and a segment may hold several calls. A
family without an end marker (Mistral) keeps its calls until generation ends.

Pure Python; safe to run on the Trio thread (microseconds per delta).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from .. import jsontext
from ..engine.text_states import TextStateMachine, make_text_state_machine

log = logging.getLogger("mlxtrio.output")

SegmentKind = Literal["text", "reasoning", "tool_call"]


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, serialised
    raw: str  # the text between the markers


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    text: str = ""
    tool_call: ParsedToolCall | None = None


class _StrayClosersHidden:
    """The tokenizer as the text state machine sees it, with the family's
    *closing* markers (``</think>``, ``</tool_call>``) added to its structural
    markers: a model that closes a block it never opened (seen from small models
    on agents' prompts) must not show the markup as answer text. mlx-lm drops a
    structural marker from the text of the state it appears in."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    @property
    def structural_markers(self) -> list[str]:
        markers = list(getattr(self._tokenizer, "structural_markers", None) or [])
        if getattr(self._tokenizer, "has_thinking", False):
            markers.append(self._tokenizer.think_end)
        if getattr(self._tokenizer, "has_tool_calling", False) and self._tokenizer.tool_call_end:
            markers.append(self._tokenizer.tool_call_end)
        return list(dict.fromkeys(m for m in markers if m))


class OutputParser:
    """Feed detokenized deltas in; get typed segments out."""

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        starts_in_reasoning: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._tools = tools
        self._machine = make_text_state_machine(_StrayClosersHidden(tokenizer))
        self._state = self._machine.make_state(
            initial=_initial_state(tokenizer, starts_in_reasoning)
        )
        self._tool_buffer: list[str] = []
        self.invalid_tool_calls = 0
        # Whitespace around markers ("</think>\n\n", "\n<tool_call>") is not content:
        # each kind's leading whitespace is dropped and trailing whitespace held
        # until non-blank text of the same kind follows.
        self._pending_space = {"text": "", "reasoning": ""}
        self._started = {"text": False, "reasoning": False}

    @property
    def state(self) -> str | None:
        return self._state[0]

    def feed(self, text: str) -> list[Segment]:
        if not text:
            return []
        self._state, pieces = TextStateMachine.split(self._state, text)
        return self._segments(pieces, final=False)

    def finish(self) -> list[Segment]:
        """Flush what was held back (generation ended)."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        segments = self._segments([(state, rest)], final=True)
        if self._tool_buffer:  # an unterminated tool call: try to salvage it
            segments.extend(self._close_tool_call())
        return segments

    def _segments(self, pieces: list[tuple[str | None, str]], final: bool) -> list[Segment]:
        out: list[Segment] = []
        last = len(pieces) - 1
        for i, (state, text) in enumerate(pieces):
            if state == "tool":
                self._tool_buffer.append(text)
                # A piece before the last one ended in a state change: the call is complete.
                if i < last:
                    out.extend(self._close_tool_call())
            elif state == "reasoning":
                self._trimmed("reasoning", text, out)
            elif state == "normal":
                self._trimmed("text", text, out)
            # Any other state is a response format's message header (Muse
            # Spark's "<|start|>assistant to=user"): not content, as in mlx-lm's
            # server.
        return out

    def _trimmed(self, kind: SegmentKind, text: str, out: list[Segment]) -> None:
        if not text:
            return
        text = self._pending_space[kind] + text
        if not self._started[kind]:
            text = text.lstrip()
        body = text.rstrip()
        self._pending_space[kind] = text[len(body) :]
        if body:
            self._started[kind] = True
            out.append(Segment(kind, body))

    def _close_tool_call(self) -> list[Segment]:
        raw = "".join(self._tool_buffer)
        self._tool_buffer.clear()
        calls = parse_tool_calls(self._tokenizer, raw, self._tools)
        # Text after a call is a new message: its leading whitespace goes too.
        self._pending_space["text"] = ""
        self._started["text"] = False
        if not calls:
            self.invalid_tool_calls += 1
            log.info("dropped a tool call that did not parse: %r", raw[:200])
        return [Segment("tool_call", tool_call=call) for call in calls]


def _initial_state(tokenizer: Any, starts_in_reasoning: bool) -> str:
    """Where the output starts: where the model's response format says (Muse
    Spark starts in a message header), else in reasoning when the prompt opened
    it, else in the answer."""
    initial = getattr(tokenizer, "response_initial_state", None)
    if isinstance(initial, str) and initial:
        return initial
    return "reasoning" if starts_in_reasoning and tokenizer.has_thinking else "normal"


def parse_tool_calls(
    tokenizer: Any, raw: str, tools: list[dict[str, Any]] | None
) -> list[ParsedToolCall]:
    """Every call in one tool-call segment. Some families' parsers (mistral,
    kimi_k2, gemma4, minimax_m2) return several calls for one segment; a parser
    that fails, or an entry without a name or with non-object arguments, yields
    nothing for that entry."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not raw.strip():
        return []
    try:
        parsed = parser(raw, tools)
    except Exception:  # family parsers raise many types on malformed markup
        return []
    entries = parsed if isinstance(parsed, list) else [parsed]
    calls = (_as_call(entry, raw) for entry in entries)
    return [call for call in calls if call is not None]


def _as_call(entry: Any, raw: str) -> ParsedToolCall | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return None
    arguments = entry.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = jsontext.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(entry["name"], json.dumps(arguments, ensure_ascii=False), raw)
