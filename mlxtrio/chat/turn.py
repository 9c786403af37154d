"""Run one assistant turn: wait for admission, generate, parse the output.

Shared by every API. The caller renders its wire events from the segments this
emits; this module knows nothing about HTTP or admission.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import Engine
from ..engine.types import GenerationStats, Match, SamplingParams
from .output import OutputParser, ParsedToolCall, Segment
from .prompt import RenderedPrompt
from .stops import StopScanner

OnSegment = Callable[[Segment], Awaitable[None]]


@dataclass
class TurnResult:
    finish_reason: str = "stop"  # stop | length | cancelled | stop_sequence
    stop_sequence: str | None = None
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    reasoning_tokens: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)


async def run_turn(
    engine: Engine,
    slot: AbstractAsyncContextManager[object],
    prompt: RenderedPrompt,
    sampling: SamplingParams,
    on_segment: OnSegment,
    tools: list[dict[str, Any]] | None = None,
    stop_sequences: list[str] | None = None,
    match: Match | None = None,
    domain: str = "",
    on_admitted: Callable[[], Awaitable[None]] | None = None,
) -> TurnResult:
    """Generate one turn, calling ``on_segment`` for each parsed segment in order.

    Enters ``slot`` first (the admission slot: a checkpoint, so cancelling the
    caller while queued leaves the queue with no engine work), then calls
    ``on_admitted``. Any exit - including
    cancellation by a client disconnect - cancels the sequence in the engine.
    Raises :class:`~mlxtrio.engine.handle.EngineError` if the engine fails.

    Stop sequences are matched on the visible text, across deltas; a match ends
    the turn at once (``finish_reason="stop_sequence"``) and stops generation.
    """
    result = TurnResult()
    parser = OutputParser(engine.tokenizer, tools, prompt.starts_in_reasoning)
    stops = StopScanner(stop_sequences or [])

    async def emit(segments: list[Segment]) -> None:
        for segment in segments:
            if stops.matched is not None:
                return
            if segment.kind == "text":
                segment = Segment("text", stops.push(segment.text))
                if not segment.text:
                    continue
                result.text += segment.text
            elif segment.kind == "reasoning":
                result.reasoning += segment.text
            elif segment.tool_call is not None:
                result.tool_calls.append(segment.tool_call)
            await on_segment(segment)

    async with slot:
        if on_admitted is not None:
            await on_admitted()
        async with engine.submit(
            prompt.tokens,
            sampling,
            match=match,
            domain=domain,
            boundary=prompt.system_end,
            vision=prompt.vision,
        ) as handle:
            async for event in handle:
                if parser.state == "reasoning":
                    result.reasoning_tokens += len(event.token_ids)
                await emit(parser.feed(event.text))
                if stops.matched is not None:
                    # Stop generating now; the final event (within one engine
                    # step) still brings exact usage.
                    handle.cancel()
                    async for _ in handle:
                        pass
                    break
            else:
                ended_in_reasoning = parser.state == "reasoning"
                await emit(parser.finish())
                await emit([Segment("text", stops.flush())] if stops.stops else [])
                if ended_in_reasoning and handle.finish_reason == "stop":
                    await emit(_answer_from_reasoning(result))
            result.stats = handle.stats
            result.finish_reason = handle.finish_reason or "stop"
    if stops.matched is not None:
        result.finish_reason, result.stop_sequence = "stop_sequence", stops.matched
    return result


def _answer_from_reasoning(result: TurnResult) -> list[Segment]:
    """A model that ended its turn inside its reasoning, having written no
    answer and called nothing, put its answer there: send it as the answer
    too, so the client never gets a turn with nothing visible (Claude Code
    discards a compaction without a text block, and nudges an empty turn).
    Reasoning cut off by the output limit is not an answer; it is left alone."""
    if result.text.strip() or result.tool_calls or not result.reasoning.strip():
        return []
    return [Segment("text", result.reasoning.strip())]
