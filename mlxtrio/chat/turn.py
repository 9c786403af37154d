"""Run one assistant turn: wait for admission, generate, parse the output.

Shared by both APIs. The caller renders its wire events from the segments this
emits; this module knows nothing about HTTP.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..admission import Ticket
from ..engine.engine import Engine
from ..engine.output import OutputParser, ParsedToolCall, Segment
from ..engine.types import GenerationStats, SamplingParams
from .prompt import RenderedPrompt

OnSegment = Callable[[Segment], Awaitable[None]]


@dataclass
class TurnResult:
    finish_reason: str = "stop"  # stop | length | cancelled
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    reasoning_tokens: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)


async def run_turn(
    engine: Engine,
    ticket: Ticket,
    prompt: RenderedPrompt,
    sampling: SamplingParams,
    on_segment: OnSegment,
    tools: list[dict[str, Any]] | None = None,
) -> TurnResult:
    """Generate one turn, calling ``on_segment`` for each parsed segment in order.

    Waits for an admission slot first (a checkpoint: cancelling the caller while
    queued leaves the queue with no engine work). Any exit - including
    cancellation by a client disconnect - cancels the sequence in the engine.
    Raises :class:`~mlxtrio.engine.handle.EngineError` if the engine fails.
    """
    result = TurnResult()
    parser = OutputParser(engine.tokenizer, tools, prompt.starts_in_reasoning)

    async def emit(segments: list[Segment]) -> None:
        for segment in segments:
            if segment.kind == "text":
                result.text += segment.text
            elif segment.kind == "reasoning":
                result.reasoning += segment.text
            elif segment.tool_call is not None:
                result.tool_calls.append(segment.tool_call)
            await on_segment(segment)

    async with ticket:
        async with engine.submit(prompt.tokens, sampling) as handle:
            async for event in handle:
                if parser.state == "reasoning":
                    result.reasoning_tokens += len(event.token_ids)
                await emit(parser.feed(event.text))
            await emit(parser.finish())
            result.finish_reason = handle.finish_reason or "stop"
            result.stats = handle.stats
    return result
