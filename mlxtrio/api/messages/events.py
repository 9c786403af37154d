"""Content blocks and stream events of one Anthropic Messages turn.

:class:`MessageAssembler` receives parsed segments in order and keeps the message's
content blocks. With an ``emit`` callback it also produces the official stream:

    message_start (full usage: real input_tokens, cache_read_input_tokens)
    per block: content_block_start -> deltas -> content_block_stop, dense indices
      thinking: thinking_delta* then signature_delta
      text:     text_delta*
      tool_use: input_json_delta chunks that concatenate to the input's JSON
    message_delta (stop_reason, stop_sequence, usage), message_stop
    -- or, on failure after the start: one ``error`` event and no message_stop.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from ...chat.output import ParsedToolCall, Segment
from ...chat.turn import TurnResult
from ...http.sse import StreamEnding, frame
from ...serving.stream import Failure, FailureKind
from .objects import (
    ContentBlock,
    MessageObject,
    MessagesUsage,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    sign_thinking,
)

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]

# Tool input JSON is sent in chunks of this many characters (clients concatenate).
JSON_CHUNK = 64

# The keepalive while nothing is produced (queueing, a long prefill).
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
# How a Messages stream ends: ``message_stop``, or one ``error`` event.
ENDING = StreamEnding(
    frozenset({"message_stop", "error"}),
    lambda sent: frame(
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "internal server error"}},
    ),
)


async def _discard(event: str, data: dict[str, Any]) -> None:
    return None


class MessageAssembler:
    """The turn's message (and, with ``emit``, its stream): the
    :class:`~mlxtrio.serving.stream.TurnEvents` of the Messages API.
    ``prompt_tokens`` and ``cached_tokens`` go into ``message_start``."""

    def __init__(
        self,
        message: MessageObject,
        emit: Emit | None = None,
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        self.message = message
        self._emit = emit or _discard
        self._open: ContentBlock | None = None
        self._prompt_tokens, self._cached_tokens = prompt_tokens, cached_tokens

    async def _send(self, event: str, **data: Any) -> None:
        await self._emit(event, {"type": event, **data})

    @property
    def _index(self) -> int:
        return len(self.message.content) - 1

    async def start(self) -> None:
        self.message.usage = usage_of(self._prompt_tokens, self._cached_tokens, 0)
        await self._send("message_start", message=self.message.wire())

    async def admitted(self) -> None:
        """Nothing to say: Anthropic streams have no queued state."""

    async def on_segment(self, segment: Segment) -> None:
        if segment.kind == "reasoning":
            block = await self._ensure_open(ThinkingBlock)
            assert isinstance(block, ThinkingBlock)
            block.thinking += segment.text
            await self._delta({"type": "thinking_delta", "thinking": segment.text})
        elif segment.kind == "text":
            block = await self._ensure_open(TextBlock)
            assert isinstance(block, TextBlock)
            block.text += segment.text
            await self._delta({"type": "text_delta", "text": segment.text})
        elif segment.tool_call is not None:
            await self._tool_use(segment.tool_call)

    async def _ensure_open(self, kind: type[TextBlock] | type[ThinkingBlock]) -> ContentBlock:
        if isinstance(self._open, kind):
            return self._open
        await self._close()
        block = kind()
        self.message.content.append(block)
        self._open = block
        await self._send(
            "content_block_start", index=self._index, content_block=block.model_dump(mode="json")
        )
        return block

    async def _delta(self, delta: dict[str, Any]) -> None:
        await self._send("content_block_delta", index=self._index, delta=delta)

    async def _close(self) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if isinstance(block, ThinkingBlock):
            block.signature = sign_thinking(block.thinking)
            await self._delta({"type": "signature_delta", "signature": block.signature})
        await self._send("content_block_stop", index=self._index)

    async def _tool_use(self, call: ParsedToolCall) -> None:
        await self._close()
        arguments = json.loads(call.arguments)
        block = ToolUseBlock(name=call.name, input={})
        self.message.content.append(block)
        await self._send(
            "content_block_start", index=self._index, content_block=block.model_dump(mode="json")
        )
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        for start in range(0, len(text), JSON_CHUNK):
            await self._delta(
                {"type": "input_json_delta", "partial_json": text[start : start + JSON_CHUNK]}
            )
        block.input = arguments
        await self._send("content_block_stop", index=self._index)

    async def finish(self, result: TurnResult) -> None:
        """Close the open block, set stop reason and usage, send the epilogue."""
        await self._close()
        if not self.message.content:  # a turn always carries at least one block
            await self._ensure_open(TextBlock)
            await self._close()
        message = self.message
        if result.finish_reason == "stop_sequence":
            message.stop_reason, message.stop_sequence = "stop_sequence", result.stop_sequence
        elif result.finish_reason == "length":
            message.stop_reason = "max_tokens"
        elif any(isinstance(b, ToolUseBlock) for b in message.content):
            message.stop_reason = "tool_use"
        else:
            message.stop_reason = "end_turn"
        stats = result.stats
        message.usage = usage_of(stats.prompt_tokens, stats.cached_tokens, stats.generated_tokens)
        await self._send(
            "message_delta",
            delta={"stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence},
            usage=message.usage.model_dump(mode="json"),
        )
        await self._send("message_stop")

    async def fail(self, failure: Failure) -> None:
        """The turn failed after the stream started: close the open block, then
        one ``error`` event; never ``message_stop``. A server shutting down, or
        out of memory for now, is ``overloaded_error`` (Claude Code retries it)."""
        await self._close()
        busy = failure.error is not None and failure.error.status in (503, 529)
        kind = "overloaded_error" if failure.kind is FailureKind.SHUTDOWN or busy else "api_error"
        error = {"type": kind, "message": failure.message}
        await self._emit("error", {"type": "error", "error": error})


def usage_of(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> MessagesUsage:
    """Anthropic counts cache reads apart: ``input_tokens`` is net of them."""
    cached = min(cached_tokens, prompt_tokens)
    return MessagesUsage(
        input_tokens=prompt_tokens - cached,
        output_tokens=output_tokens,
        cache_read_input_tokens=cached,
        cache_creation_input_tokens=0,
    )
