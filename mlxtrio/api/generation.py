"""Steps every generation route shares: render and size-check the prompt, take a
place in the admission lane, run the turn."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..admission import AdmissionLane, QueueFull, Ticket
from ..chat.conversation import Conversation, OutputFormat, ToolSpec
from ..chat.prompt import PromptError, RenderedPrompt, render
from ..chat.turn import OnSegment, TurnResult, run_turn
from ..engine.constraints import CallShape, call_shape, forbid, tool_family
from ..engine.engine import Engine
from ..engine.handle import EngineError, EngineUnavailable
from ..engine.prefix_cache import Match
from ..engine.types import GrammarConstraint, SamplingParams, TextConstraint
from ..grammar.build import ANY_OBJECT, CALL_GRAMMARS, ToolGrammar, call_grammar, output_grammar
from ..grammar.compiler import GrammarCompiler, GrammarError
from ..http.errors import ApiError, invalid_request, rate_limited, server_error, unavailable
from ..http.transport import client_domain
from .deps import access_record, on_request_end, services

log = logging.getLogger("mlxtrio.generation")


async def render_prompt(engine: Engine, conversation: Conversation) -> RenderedPrompt:
    """Token ids for ``conversation``; a 400 when it cannot be rendered or does
    not fit the model's context (answered before any stream starts).

    Rendering is CPU work on a worker thread, so it goes through the server's
    render lane (one at a time, 429 when too many wait) and a prompt that
    cannot fit is refused from its length alone, before paying for its
    tokenization (10 MB took 14 s)."""
    lower_bound = -(-prompt_characters(conversation) // engine.max_token_chars)
    if lower_bound >= engine.context_length:
        raise context_too_long(lower_bound, engine, estimated=True)
    ticket = reserve_place(services().render_lane)
    try:
        async with ticket:
            # A cache that cannot be trimmed is reused only from snapshots at
            # exact boundaries: find where the system prompt ends.
            boundary = not engine.plain_kv and engine.prefix_index.enabled
            prompt = await render(engine.tokenizer, conversation, boundary)
    except PromptError as exc:
        raise invalid_request(str(exc), "input") from None
    finally:
        ticket.release()
    if len(prompt.tokens) >= engine.context_length:
        raise context_too_long(len(prompt.tokens), engine)
    access_record().prompt_tokens = len(prompt.tokens)
    return prompt


def prompt_characters(conversation: Conversation) -> int:
    """Characters the chat template will at least render for ``conversation``."""
    total = 0
    for message in conversation.messages:
        total += len(message.content) + len(message.reasoning)
        for call in message.tool_calls:
            total += len(call.name) + len(json.dumps(call.arguments, ensure_ascii=False))
    for tool in conversation.tools:
        total += len(tool.name) + len(tool.description)
        total += len(json.dumps(tool.parameters, ensure_ascii=False))
    return total


def context_too_long(tokens: int, engine: Engine, estimated: bool = False) -> ApiError:
    """The context overflow error, worded as Anthropic words it (Claude Code
    compacts its conversation on this wording) and coded as OpenAI codes it."""
    how = " (at least; counted from its length)" if estimated else ""
    return ApiError(
        400,
        f"prompt is too long: {tokens} tokens > {engine.context_length} maximum{how}: "
        f"model {engine.name!r} has a context of {engine.context_length} tokens; "
        "shorten the input",
        "invalid_request_error",
        param="input",
        code="context_length_exceeded",
    )


def output_budget(requested: int | None, engine: Engine, prompt: RenderedPrompt) -> int:
    """The output cap: the request's, else the default; never above the server's
    maximum or the room left in the context."""
    settings = services().settings
    wanted = requested or min(settings.default_max_tokens, settings.max_output_tokens)
    room = engine.context_length - len(prompt.tokens)
    return max(1, min(wanted, settings.max_output_tokens, room))


async def output_constraints(
    engine: Engine, conversation: Conversation, prompt: RenderedPrompt
) -> tuple[TextConstraint | GrammarConstraint, ...]:
    """What the output must look like: tool calls (see
    :func:`tool_call_constraints`) and structured output. Grammars compile off
    the Trio thread (cached); a schema the grammar engine cannot hold to is
    the request's fault: a 400 naming what it cannot do, before any stream."""
    constraints = list(await tool_call_constraints(engine, conversation, prompt))
    wanted = conversation.output_format
    if wanted is not None and _required_tools(engine, conversation) is None:
        # (A required call is the answer: the format has nothing to hold.)
        constraints.append(await _structured_output(engine, conversation, prompt, wanted))
    return tuple(constraints)


def _required_tools(engine: Engine, conversation: Conversation) -> list[str] | None:
    """The tools one of which ``tool_choice`` obliges the model to call, or
    None when it need not (or cannot: no tool calling, or the named tool is
    not offered)."""
    requirement = conversation.required_tool
    offered = list(dict.fromkeys(tool.name for tool in conversation.tools))
    if requirement is None or not offered:
        return None
    if not getattr(engine.tokenizer, "has_tool_calling", False):
        return None
    if requirement.name is None:
        return offered
    return [requirement.name] if requirement.name in offered else None


async def tool_call_constraints(
    engine: Engine, conversation: Conversation, prompt: RenderedPrompt
) -> tuple[TextConstraint | GrammarConstraint, ...]:
    """What the model's tool calls must look like.

    With no tool offered (none given, or ``tool_choice`` none) the tool-call
    marker is masked where it is a token of its own: a call could only be
    dropped, leaving an empty answer. With tools, every call the model opens
    is held to its family's markup for an offered tool: in a family with a
    call grammar (:data:`~mlxtrio.grammar.build.CALL_GRAMMARS`) the whole call,
    arguments matching the tool's schema, up to its closing marker; in the
    others its opening (:data:`~mlxtrio.engine.constraints.CALL_SHAPES`). The
    model picks among the offered names by its own logits. When
    ``tool_choice`` requires a call, the output must also open one (after its
    reasoning, when the prompt starts inside it). Nothing is constrained for
    models without tool calling.
    """
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "has_tool_calling", False):
        return ()
    if not conversation.tools:
        mask = engine.tool_call_mask_token
        return (forbid(mask),) if mask is not None else ()
    offered = list(dict.fromkeys(tool.name for tool in conversation.tools))
    required = _required_tools(engine, conversation)
    # A grammar names only the tools a call may name: the required ones.
    callable_tools = [t for t in conversation.tools if t.name in (required or offered)]
    body = await _call_grammar(engine, callable_tools)
    shape = None if body is not None else call_shape(tokenizer.tool_parser)
    constraints: list[TextConstraint | GrammarConstraint] = []
    if body is not None:
        constraints.append(body)
    elif shape is not None and engine.tool_call_token is not None:
        constraints.append(
            TextConstraint(shape.openings(offered), after=engine.tool_call_token, repeat=True)
        )
    if required is None:
        return tuple(constraints)
    # With a grammar, the required opening is the marker alone.
    return (*constraints, _required_call(tokenizer, shape, required, prompt))


async def _call_grammar(engine: Engine, tools: list[ToolSpec]) -> GrammarConstraint | None:
    """The grammar every call's body follows (naming one of ``tools``), or
    None when the model's family has none (or it cannot be constrained)."""
    grammars = engine.grammars
    family = tool_family(engine.tokenizer.tool_parser)
    if grammars is None or engine.tool_call_token is None or family not in CALL_GRAMMARS:
        return None
    wanted = [await _tool_grammar(grammars, tool) for tool in tools]
    text = call_grammar(family, wanted, engine.tool_call_end_token)
    if text is None:
        return None
    try:
        matcher = await grammars.matcher(text)
    except GrammarError as exc:  # each schema passed on its own: not expected
        log.warning("tool calls are not constrained: their grammar failed: %s", exc)
        return None
    return GrammarConstraint(matcher, after=engine.tool_call_token, repeat=True, source=text)


async def _tool_grammar(grammars: GrammarCompiler, tool: ToolSpec) -> ToolGrammar:
    """``tool`` as its calls are constrained. A strict tool's schema must be
    one the grammar engine holds to exactly (a 400 otherwise); any other
    tool's keywords it does not implement are ignored, and a schema it cannot
    read at all leaves the arguments any JSON object."""
    schema = tool.arguments_schema
    error = await grammars.check_schema(schema, tool.strict)
    if error and tool.strict:
        raise invalid_request(
            f'tool "{tool.name}" is strict, but its schema cannot be enforced: {error}', "tools"
        )
    if error:
        log.info("tool %r: arguments held to any JSON object: %s", tool.name, error)
        return ToolGrammar(tool.name, ANY_OBJECT)
    return ToolGrammar(tool.name, schema, tool.strict)


async def _structured_output(
    engine: Engine, conversation: Conversation, prompt: RenderedPrompt, wanted: OutputFormat
) -> GrammarConstraint:
    """The answer is JSON matching the requested schema, then the end of the
    turn; a tool call may come instead when tools are offered. Reasoning stays
    free: the grammar starts once it closes, when the prompt opened it."""
    grammars = engine.grammars
    if grammars is None:
        raise invalid_request(
            f"model {engine.name!r} cannot be constrained to a format (the grammar engine "
            "cannot read its tokenizer)",
            wanted.param,
        )
    schema = wanted.schema
    if schema is not None:
        error = await grammars.check_schema(schema, wanted.strict)
        if error:
            raise invalid_request(f"the schema cannot be enforced: {error}", wanted.param)
    tokenizer = engine.tokenizer
    marker = engine.tool_call_token if conversation.tools else None
    after = _reasoning_end(tokenizer, prompt)
    text = output_grammar(
        schema, wanted.strict, sorted(tokenizer.eos_token_ids), marker, after is not None
    )
    try:
        matcher = await grammars.matcher(text)
    except GrammarError as exc:
        raise invalid_request(f"the schema cannot be enforced: {exc}", wanted.param) from None
    return GrammarConstraint(matcher, after=after, source=text)


def _required_call(
    tokenizer: Any, shape: CallShape | None, allowed: list[str], prompt: RenderedPrompt
) -> TextConstraint:
    """The output opens a call of one of ``allowed`` (just the start marker when
    a grammar holds the call's body, or for a family of unknown shape): from
    the first token, or after the reasoning when the prompt opened it."""
    bodies = shape.openings(allowed, canonical=True) if shape is not None else ("",)
    openings = [tokenizer.tool_call_start + body for body in bodies]
    after = _reasoning_end(tokenizer, prompt)
    if after is not None:  # what templates put between </think> and the answer
        openings = ["\n\n" + text for text in openings]
    return TextConstraint(tuple(openings), after)


def _reasoning_end(tokenizer: Any, prompt: RenderedPrompt) -> int | None:
    """The token that closes the reasoning the prompt opened, after which the
    answer's constraints start; None when the output starts with the answer
    (or the closing marker is not one token)."""
    ends: list[int] = list(tokenizer.think_end_tokens or ())
    return ends[0] if prompt.starts_in_reasoning and len(ends) == 1 else None


def reserve_place(lane: AdmissionLane) -> Ticket:
    """A place in ``lane`` (429 if its waiting room is full), released when the
    request ends, however it ends."""
    try:
        ticket = lane.reserve()
    except QueueFull as exc:
        raise rate_limited(str(exc), exc.retry_after) from None
    on_request_end(ticket.release)
    return ticket


def reserve(engine: Engine) -> Ticket:
    """A place in the model's admission lane (see :func:`reserve_place`)."""
    return reserve_place(services().lanes[engine.name])


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


async def lookup(
    engine: Engine, prompt: RenderedPrompt, domain: str = "", continuation: bool = False
) -> CacheLookup:
    """Find (and pin until the request ends) the longest cached prefix within the
    client's isolation domain (its API key) narrowed by ``domain`` (``cache_salt``)."""
    domain = "|".join(filter(None, (client_domain(), domain)))
    match = await engine.lookup(prompt.tokens, domain)
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
    on_admitted: Callable[[], Awaitable[None]] | None = None,
) -> TurnResult:
    """Run the turn, releasing the admission slot as soon as it is done
    (``on_admitted``: called once the slot is granted)."""
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
            on_admitted,
        )
    except EngineUnavailable as exc:
        raise unavailable(f"Generation could not start: {exc}; retry shortly") from None
    except EngineError as exc:
        # The cause is for the log; the client learns that it was the server's fault.
        log.error("generation failed on model %s: %s", engine.name, exc)
        raise server_error("generation failed because of an internal error; retry") from None
    finally:
        ticket.release()
    stats = result.stats
    if stats.time_to_first_token is not None:
        services().metrics.ttft.labels(engine.name).observe(stats.time_to_first_token)
    record = access_record()
    record.cached_tokens, record.generated_tokens = stats.cached_tokens, stats.generated_tokens
    record.ttft, record.finish = stats.time_to_first_token, result.finish_reason
    return result


SHUTDOWN_MESSAGE = "generation was cancelled because the server is shutting down; retry"
