"""The completion object and stream chunks of one Chat Completions turn.

:class:`ChatAssembler` receives parsed segments in order and keeps the
assistant message. With an ``emit`` callback it also produces the stream, as
OpenAI's ``chat.completion.chunk`` objects (``CreateChatCompletionStreamResponse``):

    a first chunk: delta {role: "assistant", content: ""}
    per segment: delta {content} | {reasoning_content} | {tool_calls: [one call, whole]}
    a last chunk: delta {}, finish_reason stop | length | tool_calls
    with stream_options.include_usage: a chunk with no choices and the usage
    data: [DONE]
    -- or, on failure after the start: one {"error": ...} chunk, then [DONE].

Reasoning is ``reasoning_content``, as vLLM, Ollama and LM Studio return it,
which chat clients (OpenCode, Continue, LiteLLM) show as thinking.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ...chat.output import ParsedToolCall, Segment
from ...chat.turn import TurnResult
from ...http.sse import StreamEnding, frame
from ...serving.stream import Failure, FailureKind

Emit = Callable[[dict[str, Any]], Awaitable[None]]

# Chat Completions streams have no event names and end with this frame.
DONE_FRAME = b"data: [DONE]\n\n"
_BUG_CHUNK = {"error": {"type": "server_error", "message": "internal server error", "code": None}}
# Its frames carry no event names: a stream ends with ``data: [DONE]``, which
# the producer sends itself (after an error chunk too).
ENDING = StreamEnding(frozenset(), lambda sent: frame("", _BUG_CHUNK) + DONE_FRAME)


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatAssembler:
    def __init__(
        self,
        model: str,
        custom_tools: set[str] = frozenset(),  # type: ignore[assignment]
        emit: Emit | None = None,
        include_usage: bool = False,
    ) -> None:
        self.id = new_completion_id()
        self.created = int(time.time())
        self.model = model
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict[str, Any]] = []
        self._custom = custom_tools
        self.emit = emit  # set by the stream once it starts
        self._include_usage = include_usage

    # -- the stream ----------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        """A chunk; only the last one, with no choices, carries ``usage`` (the
        published schema has no null usage)."""
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    async def _delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> None:
        if self.emit is not None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            await self.emit(self._chunk([choice]))

    async def start(self) -> None:
        await self._delta({"role": "assistant", "content": ""})

    async def admitted(self) -> None:
        """Nothing to say: a chat completion stream has no queued state."""

    async def on_segment(self, segment: Segment) -> None:
        if segment.kind == "reasoning":
            self.reasoning += segment.text
            await self._delta({"reasoning_content": segment.text})
        elif segment.kind == "text":
            self.content += segment.text
            await self._delta({"content": segment.text})
        elif segment.tool_call is not None:
            call = self._call(segment.tool_call)
            self.tool_calls.append(call)
            await self._delta({"tool_calls": [{"index": len(self.tool_calls) - 1, **call}]})

    def _call(self, parsed: ParsedToolCall) -> dict[str, Any]:
        if parsed.name in self._custom:
            text = json.loads(parsed.arguments).get("input", "")
            return {
                "id": new_call_id(),
                "type": "custom",
                "custom": {"name": parsed.name, "input": text},
            }
        return {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": parsed.name, "arguments": parsed.arguments},
        }

    async def finish(self, result: TurnResult) -> None:
        """The last chunk (its finish reason), the usage chunk when asked for."""
        await self._delta({}, self.finish_reason(result))
        if self.emit is not None and self._include_usage:
            await self.emit(self._chunk([], usage(result)))

    async def fail(self, failure: Failure) -> None:
        """The turn failed after the stream started: one error chunk (the
        producer then ends the stream with ``data: [DONE]``)."""
        if self.emit is None:
            return
        if failure.kind is FailureKind.SHUTDOWN:
            kind = "server_shutting_down"
        elif failure.error is not None:
            kind = failure.error.type
        else:
            kind = "server_error"
        await self.emit({"error": {"type": kind, "message": failure.message, "code": None}})

    # -- the whole object ------------------------------------------------------------

    def finish_reason(self, result: TurnResult) -> str:
        if result.finish_reason == "length":
            return "length"
        return "tool_calls" if self.tool_calls else "stop"

    def completion(self, result: TurnResult) -> dict[str, Any]:
        """The ``chat.completion`` object of the finished turn."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not self.tool_calls else None,
            "refusal": None,
        }
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self.finish_reason(result),
                }
            ],
            "usage": usage(result),
        }


def usage(result: TurnResult) -> dict[str, Any]:
    stats = result.stats
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": min(stats.cached_tokens, stats.prompt_tokens)},
        "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
    }
