"""Output items and stream events of one Responses API turn.

:class:`ResponseAssembler` receives parsed segments (reasoning, text, tool calls)
in order and maintains the response's output items. With an ``emit`` callback it
also produces the official streaming grammar, every event with a
``sequence_number``:

    response.created, response.in_progress,
    per item: output_item.added -> (part added -> deltas -> done ...) -> output_item.done,
    exactly one of response.completed / response.incomplete / response.failed.

Reasoning is closed before a message opens; a message is closed before a tool
call is announced.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...chat.output import ParsedToolCall, Segment
from ...chat.turn import TurnResult
from ...http.sse import StreamEnding, frame
from .objects import (
    CustomToolCallItem,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ResponseError,
    ResponseObject,
    SummaryText,
    Usage,
)

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]


def last_words(sent: int) -> dict[str, Any]:
    """The ``error`` event that ends a stream whose producer failed after
    ``sent`` events (a failure path that failed too)."""
    return {
        "type": "error",
        "sequence_number": sent,
        "code": "server_error",
        "message": "internal server error",
        "param": None,
        # Open Responses nests the error; OpenAI puts it at the top: both.
        "error": {
            "type": "server_error",
            "code": "server_error",
            "message": "internal server error",
            "param": None,
        },
    }


# How a Responses stream ends: one of its terminal events.
ENDING = StreamEnding(
    frozenset({"response.completed", "response.incomplete", "response.failed", "error"}),
    lambda sent: frame("error", last_words(sent)),
)


async def _discard(event: str, data: dict[str, Any]) -> None:
    return None


class ResponseAssembler:
    """``custom_tools`` names the freeform tools (their calls become
    ``custom_tool_call`` items); ``seal`` turns reasoning text into
    ``encrypted_content`` when the client asked for it."""

    def __init__(
        self,
        response: ResponseObject,
        emit: Emit | None = None,
        *,
        custom_tools: set[str] | None = None,
        seal: Callable[[str], str] | None = None,
    ) -> None:
        self.response = response
        self._emit = emit or _discard
        self._custom_tools = custom_tools or set()
        self._seal = seal
        self._sequence = 0
        self._reasoning: ReasoningItem | None = None
        self._message: MessageItem | None = None

    async def _send(self, event: str, **data: Any) -> None:
        payload = {"type": event, "sequence_number": self._sequence, **data}
        self._sequence += 1
        await self._emit(event, payload)

    def _index(self, item: Any) -> int:
        return self.response.output.index(item)

    async def start(self) -> None:
        """Open the stream. A queued response (background mode) announces that
        it waits; :meth:`admitted` says when it runs."""
        snapshot = self.response.wire()
        await self._send("response.created", response=snapshot)
        if self.response.status == "queued":
            await self._send("response.queued", response=snapshot)
        else:
            await self._send("response.in_progress", response=snapshot)

    async def admitted(self) -> None:
        """The turn got its admission slot: a queued response is in progress."""
        if self.response.status == "queued":
            self.response.status = "in_progress"
            await self._send("response.in_progress", response=self.response.wire())

    async def on_segment(self, segment: Segment) -> None:
        if segment.kind == "reasoning":
            await self._reasoning_delta(segment.text)
        elif segment.kind == "text":
            await self._text_delta(segment.text)
        elif segment.tool_call is not None:
            await self._tool_call(segment.tool_call)

    # -- reasoning ---------------------------------------------------------

    async def _reasoning_delta(self, text: str) -> None:
        if self._message is not None:
            await self._close_message("completed")
        item = self._reasoning
        if item is None:
            item = self._reasoning = ReasoningItem(summary=[])
            self.response.output.append(item)
            await self._send(
                "response.output_item.added",
                output_index=self._index(item),
                item=item.model_dump(mode="json"),
            )
            item.summary.append(SummaryText(text=""))
            await self._send(
                "response.reasoning_summary_part.added",
                item_id=item.id,
                output_index=self._index(item),
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
        item.summary[0].text += text
        await self._send(
            "response.reasoning_summary_text.delta",
            item_id=item.id,
            output_index=self._index(item),
            summary_index=0,
            delta=text,
        )

    async def _close_reasoning(self, status: str = "completed") -> None:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return
        item.status = status  # type: ignore[assignment]
        index, text = self._index(item), item.summary[0].text
        if self._seal is not None:
            item.encrypted_content = self._seal(text)
        await self._send(
            "response.reasoning_summary_text.done",
            item_id=item.id,
            output_index=index,
            summary_index=0,
            text=text,
        )
        await self._send(
            "response.reasoning_summary_part.done",
            item_id=item.id,
            output_index=index,
            summary_index=0,
            part={"type": "summary_text", "text": text},
        )
        await self._send(
            "response.output_item.done", output_index=index, item=item.model_dump(mode="json")
        )

    # -- message -----------------------------------------------------------

    async def _text_delta(self, text: str) -> None:
        await self._close_reasoning()
        item = self._message
        if item is None:
            item = self._message = MessageItem()
            self.response.output.append(item)
            index = self._index(item)
            await self._send(
                "response.output_item.added", output_index=index, item=item.model_dump(mode="json")
            )
            item.content.append(OutputText())
            await self._send(
                "response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=OutputText().model_dump(mode="json"),
            )
        item.content[0].text += text
        await self._send(
            "response.output_text.delta",
            item_id=item.id,
            output_index=self._index(item),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    async def _close_message(self, status: str) -> None:
        item, self._message = self._message, None
        if item is None:
            return
        item.status = status  # type: ignore[assignment]
        index, part = self._index(item), item.content[0]
        await self._send(
            "response.output_text.done",
            item_id=item.id,
            output_index=index,
            content_index=0,
            text=part.text,
            logprobs=[],
        )
        await self._send(
            "response.content_part.done",
            item_id=item.id,
            output_index=index,
            content_index=0,
            part=part.model_dump(mode="json"),
        )
        await self._send(
            "response.output_item.done", output_index=index, item=item.model_dump(mode="json")
        )

    # -- tool calls --------------------------------------------------------

    async def _tool_call(self, call: ParsedToolCall) -> None:
        await self._close_reasoning()
        await self._close_message("completed")
        if call.name in self._custom_tools:
            await self._custom_tool_call(call)
            return
        item = FunctionCallItem(name=call.name, arguments="", status="in_progress")
        self.response.output.append(item)
        index = self._index(item)
        await self._send(
            "response.output_item.added", output_index=index, item=item.model_dump(mode="json")
        )
        await self._send(
            "response.function_call_arguments.delta",
            item_id=item.id,
            output_index=index,
            delta=call.arguments,
        )
        item.arguments = call.arguments
        await self._send(
            "response.function_call_arguments.done",
            item_id=item.id,
            output_index=index,
            name=call.name,
            arguments=call.arguments,
        )
        item.status = "completed"
        await self._send(
            "response.output_item.done", output_index=index, item=item.model_dump(mode="json")
        )

    async def _custom_tool_call(self, call: ParsedToolCall) -> None:
        arguments = json.loads(call.arguments)
        raw = arguments.get("input")
        text = raw if isinstance(raw, str) else json.dumps(arguments, ensure_ascii=False)
        item = CustomToolCallItem(name=call.name, input="", status="in_progress")
        self.response.output.append(item)
        index = self._index(item)
        await self._send(
            "response.output_item.added", output_index=index, item=item.model_dump(mode="json")
        )
        await self._send(
            "response.custom_tool_call_input.delta", item_id=item.id, output_index=index, delta=text
        )
        item.input = text
        await self._send(
            "response.custom_tool_call_input.done", item_id=item.id, output_index=index, input=text
        )
        item.status = "completed"
        await self._send(
            "response.output_item.done", output_index=index, item=item.model_dump(mode="json")
        )

    # -- terminal ----------------------------------------------------------

    async def complete(self, result: TurnResult, extra_usage: dict[str, Any] | None = None) -> None:
        """Close open items and finalise the response object (status, usage); the
        terminal event is not sent yet, so the caller can store the response first."""
        incomplete = result.finish_reason == "length"
        await self._close_reasoning("incomplete" if incomplete else "completed")
        await self._close_message("incomplete" if incomplete else "completed")
        response = self.response
        response.status = "incomplete" if incomplete else "completed"
        response.incomplete_details = (
            IncompleteDetails(reason="max_output_tokens") if incomplete else None
        )
        response.completed_at = None if incomplete else int(time.time())
        response.output_text = "".join(
            part.text
            for item in response.output
            if isinstance(item, MessageItem)
            for part in item.content
        )
        response.usage = usage_of(result, extra_usage)

    async def announce(self) -> None:
        """Send the terminal event for the response's status: response.completed,
        response.incomplete, or response.failed (for failed and cancelled)."""
        terminal = {
            "incomplete": "response.incomplete",
            "failed": "response.failed",
            "cancelled": "response.failed",
        }
        event = terminal.get(self.response.status, "response.completed")
        await self._send(event, response=self.response.wire())

    async def mark_failed(self, message: str, code: str = "server_error") -> None:
        """The turn failed after the stream started: close open items and set
        the failed status; :meth:`announce` then sends response.failed."""
        await self._close_reasoning("incomplete")
        await self._close_message("incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError.of(code, message)

    async def mark_cancelled(self) -> None:
        """A background response cancelled by its client: close open items and
        set the cancelled status (no error: it did not fail)."""
        await self._close_reasoning("incomplete")
        await self._close_message("incomplete")
        self.response.status = "cancelled"


def usage_of(result: TurnResult, extra: dict[str, Any] | None = None) -> Usage:
    stats = result.stats
    cached = min(stats.cached_tokens, stats.prompt_tokens)
    usage = Usage(
        input_tokens=stats.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=stats.generated_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=result.reasoning_tokens),
        total_tokens=stats.prompt_tokens + stats.generated_tokens,
    )
    timings: dict[str, Any] = {"prefill_input_tokens": stats.prompt_tokens - cached}
    if cached:
        timings["cached_prefix_tokens"] = cached
    if stats.time_to_first_token:
        ttft_ms = stats.time_to_first_token * 1000
        timings["time_to_first_token_ms"] = timings["server_time_to_first_token_ms"] = ttft_ms
    if stats.prefill_tokens_per_second:
        timings["prefill_tokens_per_second"] = stats.prefill_tokens_per_second
        timings["server_prefill_tokens_per_second"] = stats.prefill_tokens_per_second
    if stats.decode_tokens_per_second:
        timings["decode_tokens_per_second"] = stats.decode_tokens_per_second
        timings["server_decode_tokens_per_second"] = stats.decode_tokens_per_second
    for key, value in {**timings, **(extra or {})}.items():
        setattr(usage, key, value)
    return usage
