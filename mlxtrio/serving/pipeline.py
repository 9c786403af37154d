"""The one path every generation takes from a converted request to a running
turn, in the one order that is right.

:func:`prepare` (every generation route calls it, and the WebSocket and
background paths):

0. **images**: every image the request carries is decoded and checked on a
   worker thread (400 naming the bad one: :mod:`.images`) - before the model is
   resolved, so a bad image never loads or evicts a model;
1. **resolve** the model the request names (404 unknown, 503 not serving);
2. **render** the conversation with the model's chat template, on a worker
   thread behind the render lane (400 when it cannot be rendered or does not
   fit the context; a prompt that cannot fit is refused from its length alone,
   before paying for its tokenization);
3. **budget** the output: the request's cap or the default, within the room
   left in the context (400 when less room is left than the turn needs), and
   the KV memory prompt and output can reach (400 when that could not fit the
   memory budget even with nothing else running: :mod:`.memory`);
4. **constraints**: what the output must look like (tool calls, structured
   output; 400 for what cannot be held to), compiled off the Trio thread;
5. **admission place** in the model's lane (429 at once when the waiting room
   is full) - before the lookup, so a request that waits for another's
   prefill holds its place meanwhile;
6. **prefix lookup**: the longest cached prefix, pinned until the call ends, so
   ``X-Cached-Tokens`` is exact before any header is sent (and why less was
   reused than the session's previous turn offered: :mod:`.cache_watch`).

Everything that can fail because of the request fails here, as an
:class:`~mlxtrio.http.errors.ApiError`, before a stream starts; the place and
the pinned prefix are released when the call ends, however it ends. Then
:meth:`PreparedTurn.run` generates (see :mod:`.stream` for streams).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from ..chat.conversation import Conversation
from ..chat.images import CheckedImage
from ..chat.prompt import PromptError, RenderedPrompt, render
from ..chat.turn import OnSegment, TurnResult, run_turn
from ..engine.engine import Engine
from ..engine.handle import EngineError, EngineUnavailable
from ..engine.types import Match, SamplingParams
from ..grammar.planning import ConstraintError, OutputPlan, plan_output
from ..http.errors import ApiError, invalid_request, rate_limited, server_error, unavailable
from ..http.transport import client_domain, client_session
from .admission import AdmissionLane, QueueFull, Ticket
from .call import access_record, on_call_end, services
from .images import check_images, note_images
from .models import output_facts, resolve

log = logging.getLogger("mlxtrio.generation")

SHUTDOWN_MESSAGE = "generation was cancelled because the server is shutting down; retry"


@dataclass(frozen=True)
class TurnRequest:
    """What a route asks of the pipeline, once its request is parsed and
    converted: nothing here is in an API's terms any more."""

    model: str
    conversation: Conversation
    # The request's sampling; the pipeline sets its output cap and constraints.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # the request's output cap (None: the default)
    default_max_tokens: int | None = None  # the default, when not the server's
    min_output_tokens: int = 1  # room the output needs in the context at least
    stop_sequences: tuple[str, ...] = ()
    cache_domain: str = ""  # narrows the client's cache domain (``cache_salt``)
    continuation: bool = False  # continues a stored response (cache header wording)
    session: str | None = None  # the conversation it belongs to (``prompt_cache_key``)
    # False: the turn is answered without running (a warm-up with nothing to
    # prefill); its prompt never reaches the cache, so the cache watch does not
    # take it for the session's previous turn.
    runs: bool = True


@dataclass(frozen=True)
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


@dataclass
class PreparedTurn:
    """A turn that passed every check and holds its admission place: ready to
    generate. Only :attr:`sampling` may still change (a warm-up's cap)."""

    engine: Engine
    request: TurnRequest
    prompt: RenderedPrompt
    sampling: SamplingParams
    ticket: Ticket
    cache: CacheLookup
    kv_bytes: int = 0  # the KV cache it can reach, held while it runs

    @property
    def conversation(self) -> Conversation:
        return self.request.conversation

    async def run(
        self, on_segment: OnSegment, on_admitted: Callable[[], Awaitable[None]] | None = None
    ) -> TurnResult:
        """Generate the turn, calling ``on_segment`` for each parsed segment:
        waits for the admission slot and the memory its KV can reach (a client
        that leaves meanwhile costs no engine work; memory that does not free
        within a while is a 503), calls ``on_admitted`` once it has both, and releases it as
        soon as generation ends. Cancellation stops the sequence at the
        engine's next safepoint. An engine failure is a 503 (retry) or 500."""
        engine, conversation = self.engine, self.conversation
        tools = [t.template_dict() for t in conversation.tools] or None
        try:
            result = await run_turn(
                engine,
                self._admitted(),
                self.prompt,
                self.sampling,
                on_segment,
                tools,
                list(self.request.stop_sequences),
                self.cache.match,
                self.cache.domain,
                on_admitted,
            )
        except EngineUnavailable as exc:
            raise unavailable(f"Generation could not start: {exc}; retry shortly") from None
        except EngineError as exc:
            # The cause is for the log; the client learns that it was the server's fault.
            log.error("generation failed on model %s: %s", engine.name, exc)
            raise server_error("generation failed because of an internal error; retry") from None
        finally:
            self.ticket.release()
        _account(engine, result)
        return result

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        """The admission slot, then the memory its KV can reach (waiting for
        both; a hang-up while waiting costs no engine work)."""
        what = f"{len(self.prompt.tokens)} prompt + {self.sampling.max_tokens} output tokens"
        async with self.ticket, services().memory.reserved_for(self.kv_bytes, what):
            yield

    async def complete(self, on_segment: OnSegment) -> TurnResult:
        """:meth:`run`, for an answer sent whole: a turn the server cancelled
        (it is shutting down) is a 503."""
        result = await self.run(on_segment)
        if result.finish_reason == "cancelled":
            raise unavailable(SHUTDOWN_MESSAGE)
        return result


async def prepare(request: TurnRequest) -> PreparedTurn:
    """Steps 0-6 of the module docstring, within the current call. Raises
    :class:`ApiError` for anything that is the request's fault."""
    engine, prompt = await render_for_model(request.model, request.conversation)
    max_tokens = output_budget(engine, prompt, request)
    plan = await _output_plan(engine, request.conversation, prompt)
    sampling = replace(
        request.sampling,
        max_tokens=max_tokens,
        constraints=plan.constraints,
        stop_token_ids=(*request.sampling.stop_token_ids, *plan.stop_token_ids),
        reasoning_budget=_reasoning_budget(request, prompt, plan),
    )
    kv_bytes = _kv_bytes(engine, len(prompt.tokens) + max_tokens)
    ticket = reserve_place(services().lanes[engine.name])
    cache = await lookup(engine, prompt, request.cache_domain, request.continuation)
    if request.runs:
        _watch_cache(engine, request, prompt, cache)
    return PreparedTurn(engine, request, prompt, sampling, ticket, cache, kv_bytes)


async def render_for_model(model: str, conversation: Conversation) -> tuple[Engine, RenderedPrompt]:
    """Steps 0, 1 and 2: the engine and the prompt's token ids, exactly as
    generation would render them (what token counting answers)."""
    checked = await check_images(conversation)
    engine = await resolve(model)
    note_images(engine, conversation)
    return engine, await render_prompt(engine, conversation, checked)


async def render_prompt(
    engine: Engine, conversation: Conversation, checked: list[CheckedImage] | None = None
) -> RenderedPrompt:
    """Token ids for ``conversation``; a 400 when it cannot be rendered or does
    not fit the model's context. Rendering is CPU work on a worker thread, one
    at a time through the server's render lane (429 when too many wait);
    cancelling the caller waits for the render in progress (bounded by the
    size check before it)."""
    loaded = engine.loaded
    assert loaded is not None, "render_prompt() for a model that is not loaded"
    lower_bound = -(-prompt_characters(conversation) // loaded.max_token_chars)
    if lower_bound >= engine.context_length:
        raise context_too_long(lower_bound, engine, estimated=True)
    ticket = reserve_place(services().render_lane)
    try:
        async with ticket:
            # A cache that cannot be trimmed is reused only from snapshots at
            # exact boundaries: find where the system prompt ends.
            boundary = not loaded.plain_kv and engine.cache.enabled
            prompt = await render(engine.tokenizer, conversation, boundary, loaded.images, checked)
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


def output_budget(engine: Engine, prompt: RenderedPrompt, request: TurnRequest) -> int:
    """The output cap: the request's, else the default; never above the server's
    maximum or the room left in the context. A 400 when the room left is less
    than the turn needs (``min_output_tokens``)."""
    settings = services().settings
    default = min(
        request.default_max_tokens or settings.default_max_tokens, settings.max_output_tokens
    )
    wanted = request.max_tokens or default
    room = engine.context_length - len(prompt.tokens)
    if room < request.min_output_tokens:
        raise ApiError(
            400,
            f"prompt is too long: {len(prompt.tokens)} tokens leave {room} of model "
            f"{engine.name!r}'s {engine.context_length}-token context for the output, which "
            f"needs at least {request.min_output_tokens}; shorten the input",
            "invalid_request_error",
            param="input",
            code="context_length_exceeded",
        )
    return max(1, min(wanted, settings.max_output_tokens, room))


async def _output_plan(
    engine: Engine, conversation: Conversation, prompt: RenderedPrompt
) -> OutputPlan:
    try:
        return await plan_output(output_facts(engine), conversation, prompt.starts_in_reasoning)
    except ConstraintError as exc:
        raise invalid_request(exc.message, exc.param) from None


def _kv_bytes(engine: Engine, tokens: int) -> int:
    """The KV cache ``tokens`` tokens take on ``engine``'s model; a 400 now
    when that could not fit the memory budget even with nothing else running."""
    assert engine.loaded is not None
    need = tokens * engine.loaded.kv_bytes_per_token
    services().memory.check_fits(need, f"{tokens} tokens of prompt and output")
    return need


def _watch_cache(
    engine: Engine, request: TurnRequest, prompt: RenderedPrompt, cache: CacheLookup
) -> None:
    """Note why a turn reused less than its session offered (log, metric,
    access line: see :mod:`.cache_watch`)."""
    if not engine.cache.enabled:
        return
    svc = services()
    cause = svc.cache_watch.observe(
        model=engine.name,
        domain=cache.domain,
        session=request.session or client_session(),
        prompt=prompt.tokens,
        cached=cache.cached_tokens,
        decode=engine.tokenizer.decode,
    )
    if cause is not None:
        svc.metrics.cache_misses.labels(engine.name, cause).inc()
        access_record().cache_miss = cause


def _reasoning_budget(request: TurnRequest, prompt: RenderedPrompt, plan: OutputPlan) -> int | None:
    """A budget bounds only reasoning the prompt opened: the request's, when
    it asked for reasoning; the plan's, when nobody asked for it."""
    if not prompt.starts_in_reasoning:
        return None
    if request.conversation.thinking:
        return request.sampling.reasoning_budget
    return plan.reasoning_budget


def reserve_place(lane: AdmissionLane) -> Ticket:
    """A place in ``lane`` (429 if its waiting room is full), released when the
    call ends, however it ends."""
    try:
        ticket = lane.reserve()
    except QueueFull as exc:
        raise rate_limited(str(exc), exc.retry_after) from None
    on_call_end(ticket.release)
    return ticket


async def lookup(
    engine: Engine, prompt: RenderedPrompt, domain: str = "", continuation: bool = False
) -> CacheLookup:
    """Find (and pin until the call ends) the longest cached prefix within the
    client's isolation domain (its API key) narrowed by ``domain`` (``cache_salt``).
    Cancelling it leaves nothing pinned."""
    domain = "|".join(filter(None, (client_domain(), domain)))
    match = await engine.lookup(prompt.tokens, domain, prompt.vision)
    on_call_end(lambda: engine.release(match))
    return CacheLookup(match, domain, continuation)


def _account(engine: Engine, result: TurnResult) -> None:
    """The turn's figures for /metrics and its access-log line."""
    stats = result.stats
    if stats.time_to_first_token is not None:
        services().metrics.ttft.labels(engine.name).observe(stats.time_to_first_token)
    record = access_record()
    record.cached_tokens, record.generated_tokens = stats.cached_tokens, stats.generated_tokens
    record.draft_tokens, record.accepted_tokens = stats.draft_tokens, stats.accepted_tokens
    record.ttft, record.finish = stats.time_to_first_token, result.finish_reason
