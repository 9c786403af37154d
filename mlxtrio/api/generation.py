"""Steps every generation route shares: render and size-check the prompt, take a
place in the admission lane, run the turn."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..admission import QueueFull, Ticket
from ..chat.conversation import Conversation
from ..chat.prompt import PromptError, RenderedPrompt, render
from ..chat.turn import OnSegment, TurnResult, run_turn
from ..engine.engine import Engine
from ..engine.handle import EngineError
from ..engine.prefix_cache import Match
from ..engine.types import SamplingParams
from ..http.errors import invalid_request, rate_limited, server_error
from ..http.transport import client_domain
from .deps import on_request_end, services


async def render_prompt(engine: Engine, conversation: Conversation) -> RenderedPrompt:
    """Token ids for ``conversation``; a 400 when it cannot be rendered or does
    not fit the model's context (answered before any stream starts)."""
    try:
        prompt = await render(engine.tokenizer, conversation)
    except PromptError as exc:
        raise invalid_request(str(exc), "input") from None
    if len(prompt.tokens) >= engine.context_length:
        raise invalid_request(
            f"context_length_exceeded: the prompt has {len(prompt.tokens)} tokens but "
            f"model {engine.name!r} has a context of {engine.context_length}; shorten the input"
        )
    return prompt


def output_budget(requested: int | None, engine: Engine, prompt: RenderedPrompt) -> int:
    """The output cap: the request's, else the default; never above the server's
    maximum or the room left in the context."""
    settings = services().settings
    wanted = requested or min(settings.default_max_tokens, settings.max_output_tokens)
    room = engine.context_length - len(prompt.tokens)
    return max(1, min(wanted, settings.max_output_tokens, room))


@dataclass(frozen=True)
class ForcedOpening:
    """How a required tool call is enforced: the texts the output must start with
    one of, and the token after which they start (end of reasoning), if any."""

    openings: tuple[str, ...] = ()
    after: int | None = None


def forced_tool_call(
    engine: Engine, conversation: Conversation, prompt: RenderedPrompt
) -> ForcedOpening:
    """Make generation open a tool call when ``tool_choice`` requires one.

    The model's own tool-call marker is forced (after its reasoning, when the
    prompt starts inside it). For the Hermes JSON format the call also starts
    with ``{"name": "<tool>", "arguments":`` for one of the allowed tools: the
    named one, or any offered one (the model picks by its own logits), so the
    call always names a tool the client offered. Nothing is forced for models
    without tool calling.
    """
    requirement, tokenizer = conversation.required_tool, engine.tokenizer
    if requirement is None or not conversation.tools or not tokenizer.has_tool_calling:
        return ForcedOpening()
    offered = [tool.name for tool in conversation.tools]
    if requirement.name is not None and requirement.name not in offered:
        return ForcedOpening()
    openings = [tokenizer.tool_call_start]
    parser_module = getattr(tokenizer.tool_parser, "__module__", "")
    if parser_module.endswith(".json_tools"):
        allowed = [requirement.name] if requirement.name is not None else offered
        # No trailing space: models emit ' {' as one token after the colon.
        openings = [
            tokenizer.tool_call_start
            + '{"name": '
            + json.dumps(name, ensure_ascii=False)
            + ', "arguments":'
            for name in dict.fromkeys(allowed)
        ]
    after = None
    if prompt.starts_in_reasoning and len(tokenizer.think_end_tokens or ()) == 1:
        after = tokenizer.think_end_tokens[0]
        # what templates put between </think> and the answer
        openings = ["\n\n" + text for text in openings]
    return ForcedOpening(tuple(openings), after)


def reserve(engine: Engine) -> Ticket:
    """A place in the model's admission lane (429 if the waiting room is full),
    released when the request ends, however it ends."""
    try:
        ticket = services().lanes[engine.name].reserve()
    except QueueFull as exc:
        raise rate_limited(str(exc), exc.retry_after) from None
    on_request_end(ticket.release)
    return ticket


@dataclass
class CacheLookup:
    """The prefix-cache match of one request, known before any header is sent."""

    match: Match | None
    domain: str
    continuation: bool

    @property
    def cached_tokens(self) -> int:
        return self.match.length if self.match is not None else 0

    def headers(self) -> dict[str, str]:
        if self.continuation:
            state = "hit" if self.cached_tokens else "cold_replay"
        else:
            state = "prefix_hit" if self.cached_tokens else "fresh"
        return {"X-Session-Cache": state, "X-Cached-Tokens": str(self.cached_tokens)}


def lookup(
    engine: Engine, prompt: RenderedPrompt, domain: str = "", continuation: bool = False
) -> CacheLookup:
    """Find (and pin until the request ends) the longest cached prefix within the
    client's isolation domain (its API key) narrowed by ``domain`` (``cache_salt``)."""
    domain = "|".join(filter(None, (client_domain(), domain)))
    match = engine.lookup(prompt.tokens, domain)
    on_request_end(lambda: engine.release(match))
    return CacheLookup(match, domain, continuation)


async def generate(
    engine: Engine,
    ticket: Ticket,
    prompt: RenderedPrompt,
    sampling: SamplingParams,
    conversation: Conversation,
    on_segment: OnSegment,
    cache: CacheLookup,
    stop_sequences: list[str] | None = None,
) -> TurnResult:
    """Run the turn, releasing the admission slot as soon as it is done."""
    tools: list[dict[str, Any]] | None = [t.template_dict() for t in conversation.tools] or None
    try:
        result = await run_turn(
            engine,
            ticket,
            prompt,
            sampling,
            on_segment,
            tools,
            stop_sequences,
            cache.match,
            cache.domain,
        )
    except EngineError as exc:
        raise server_error(f"generation failed: {exc}") from None
    finally:
        ticket.release()
    if result.stats.time_to_first_token is not None:
        services().metrics.ttft.labels(engine.name).observe(result.stats.time_to_first_token)
    return result


SHUTDOWN_MESSAGE = "generation was cancelled because the server is shutting down; retry"
