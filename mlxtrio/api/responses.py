"""``POST /v1/responses``: a turn as JSON or SSE, and the steps every transport
of it shares (:func:`begin`, :func:`produce_events`: SSE here, WebSocket in
``responses_socket``, a job's event log in ``responses_background``). Stored
responses are served by ``responses_stored``.

Everything that can fail because of the request (validation, unknown model or
previous response, tool order, context overflow, a full waiting room) is answered
as a JSON error *before* any byte of a stream is sent.

Persistence is write-ahead-then-announce (``responses_persist``); a turn the
store could not take is still delivered, and a later continuation from it gets
a clear 404. Failed, cancelled and
disconnected turns are never stored - except background responses, whose
clients poll for how they ended (``responses_background``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from quart import Blueprint, Response

from ..admission import Ticket
from ..chat.chain import check_delta, drop_echoed_calls, outstanding_calls, reconstruct
from ..chat.conversation import Conversation, Message
from ..chat.from_responses import map_items, offered_tools, output_format, required_tool
from ..chat.prompt import RenderedPrompt
from ..chat.tool_order import OPENAI, ToolOrderError, validate_tool_order
from ..chat.turn import OnSegment, TurnResult
from ..engine.engine import Engine
from ..engine.types import SamplingParams
from ..http.delivery import tracked_json
from ..http.errors import ApiError, invalid_request, unavailable
from ..http.sse import CLIENT_GONE, RESPONSES, SSE_HEADERS, EventSink, EventStream, Producer
from ..http.transport import client_domain, read_json_body
from ..protocol.openai_responses import (
    ResponseObject,
    TextConfig,
)
from ..protocol.responses_requests import ResponsesRequest
from ..protocol.responses_tools import FunctionTool, Tool
from ..store import StoredResponse, StoreError
from .deps import request_nursery, resolve_engine, services
from .generation import (
    SHUTDOWN_MESSAGE,
    CacheLookup,
    generate,
    lookup,
    output_budget,
    output_constraints,
    render_prompt,
    reserve,
)
from .responses_events import ResponseAssembler
from .responses_persist import open_store, persist, store_failure, take_back_unless
from .validation import conversation_errors, parse

log = logging.getLogger("mlxtrio.responses")

blueprint = Blueprint("responses", __name__)


@dataclass
class Turn:
    """Everything a validated request needs to generate and be stored."""

    request: ResponsesRequest
    engine: Engine
    conversation: Conversation
    delta: list[Message]  # what this turn adds to the stored chain
    instructions: str | None  # effective (inherited on continuations)
    owner: str  # the client's domain: who may read and continue it
    chain: list[StoredResponse] = field(default_factory=list)  # the turns it continues


@dataclass
class Run:
    """A validated, rendered and admitted turn, ready to generate: everything
    that can fail because of the request has been checked."""

    turn: Turn
    prompt: RenderedPrompt
    sampling: SamplingParams
    cache: CacheLookup
    ticket: Ticket
    response: ResponseObject


async def begin(
    request: ResponsesRequest, recall: Recall | None = None, *, warm_up: bool = False
) -> Run:
    """Resolve, render, look up the cache and take a place in the admission
    lane, within the current call (its end releases the place and the pinned
    prefix). Raises :class:`ApiError` for anything that is the request's fault."""
    turn = await prepare(request, recall, allow_empty=warm_up)
    prompt = await render_prompt(turn.engine, turn.conversation)
    sampling = request.sampling_params(
        max_tokens=output_budget(request.max_output_tokens, turn.engine, prompt),
        constraints=await output_constraints(turn.engine, turn.conversation, prompt),
    )
    continuation = request.previous_response_id is not None
    ticket = reserve(turn.engine)
    cache = await lookup(turn.engine, prompt, cache_domain(request), continuation)
    return Run(turn, prompt, sampling, cache, ticket, initial_response(turn, sampling))


@blueprint.route("/v1/responses", methods=["POST"])
async def create_response() -> Response:
    request = parse(ResponsesRequest, await read_json_body())
    if request.background:
        from .responses_background import start_background

        return await start_background(request)
    run = await begin(request)
    if request.stream:
        return stream_response(run)
    response = run.response
    assembler = make_assembler(run.turn, response)
    result = await run_generation(run, assembler.on_segment)
    if result.finish_reason == "cancelled":
        raise unavailable(SHUTDOWN_MESSAGE)
    await assembler.complete(result)
    stored = await persist(run.turn, response)
    out, delivery = tracked_json(response.wire())
    if stored:
        take_back_unless(lambda: delivery.delivered, response.id)
    out.headers.update(run.cache.headers())
    return out


async def run_generation(
    run: Run, on_segment: OnSegment, on_admitted: Callable[[], Awaitable[None]] | None = None
) -> TurnResult:
    turn = run.turn
    return await generate(
        turn.engine,
        run.ticket,
        run.prompt,
        run.sampling,
        turn.conversation,
        on_segment,
        run.cache,
        on_admitted=on_admitted,
    )


async def produce_events(
    run: Run,
    assembler: ResponseAssembler,
    delivered: Callable[[], bool],
    *,
    keep_unfinished: bool = False,
) -> None:
    """Generate ``run`` as a stream of Responses events sent through the
    ``assembler``'s emit, whatever the transport (SSE, a WebSocket, a
    background job's event log).

    The stream always ends with its terminal event, failures included; a
    completed turn is stored before that event goes out, and taken back when
    the call ends unless ``delivered()`` says the client saw the end. With
    ``keep_unfinished`` (background responses, which clients poll) a failed
    turn is stored too. Exceptions from ``emit`` (the client left) propagate.
    """
    response = run.response
    try:
        await assembler.start()
        result = await run_generation(run, assembler.on_segment, assembler.admitted)
        if result.finish_reason == "cancelled":  # only the server cancels a live stream
            await _fail(run, assembler, SHUTDOWN_MESSAGE, "server_shutting_down", keep_unfinished)
            return
        await assembler.complete(result)
        # A background turn is stored whatever happens to its job now.
        with trio.CancelScope(shield=keep_unfinished):
            stored = await persist(run.turn, response)
        if stored and not keep_unfinished:
            take_back_unless(delivered, response.id)
        await assembler.announce()
    except ApiError as exc:
        await _fail(run, assembler, exc.message, "server_error", keep_unfinished)
    except CLIENT_GONE:
        raise
    except Exception:  # a bug: the stream still ends with its terminal event
        log.exception("response %s failed", response.id)
        await _fail(run, assembler, "internal server error", "server_error", keep_unfinished)


async def _fail(
    run: Run, assembler: ResponseAssembler, message: str, code: str, keep: bool
) -> None:
    """End the stream with ``response.failed`` (stored first when ``keep``)."""
    await assembler.mark_failed(message, code)
    if keep:
        with trio.CancelScope(shield=True):
            await persist(run.turn, run.response)
    await assembler.announce()


def cache_domain(request: ResponsesRequest) -> str:
    """``cache_salt`` isolates cached prefixes: requests share KV only within a salt."""
    return "" if request.cache_salt is None else "salt:" + request.cache_salt


class Recall(Protocol):
    """Where a transport keeps responses it can continue without the store
    (a WebSocket connection's last response): the chain ending at an id, or None."""

    def __call__(self, response_id: str) -> list[StoredResponse] | None: ...


async def prepare(
    request: ResponsesRequest, recall: Recall | None = None, *, allow_empty: bool = False
) -> Turn:
    """Resolve the model and the chain, map and validate the input (spec §3.4).
    ``recall`` is asked for the previous response before the store is. An
    empty conversation is refused unless ``allow_empty`` (a warm-up: its tools
    and instructions are worth prefilling on their own)."""
    engine = resolve_engine(request.model)
    prior: list[Message] = []
    instructions = request.instructions
    items = request.items
    # A continuation must answer its parent's calls; a parent without output
    # (a warm-up) has none, and what follows it is checked as a history is.
    continuation = False
    chain: list[StoredResponse] = []
    if request.previous_response_id is not None:
        chain = await _chain_ending_at(request.previous_response_id, recall)
        prior = reconstruct(chain)
        continuation = bool(chain[-1].response.get("output"))
        if request.instructions is None:
            instructions = chain[-1].instructions
    with conversation_errors():
        if continuation:
            items = drop_echoed_calls(items, prior)
        delta = map_items(items, services().sealer.open)
        if continuation:
            delta = check_delta(delta, outstanding_calls(prior))
    head = [Message("system", instructions)] if instructions else []
    messages = head + prior + delta
    try:
        validate_tool_order(messages, OPENAI)
    except ToolOrderError as exc:
        raise invalid_request(str(exc), "input") from None
    delta = messages[len(head) + len(prior) :]  # after canonical reordering
    if not messages:
        if not allow_empty:
            raise invalid_request(
                "input is empty and there are no instructions: nothing to respond to", "input"
            )
        # Templates render no empty conversation: the warm-up renders its tools
        # ahead of an empty user turn, and only what precedes that turn is
        # shared with what follows. It is not part of the turn (``delta``).
        messages = [Message("user", "")]
    with conversation_errors():
        tools = offered_tools(request)
    conversation = Conversation(
        messages, tools, request.thinking, required_tool(request), output_format(request)
    )
    return Turn(request, engine, conversation, delta, instructions, client_domain(), chain)


async def _chain_ending_at(response_id: str, recall: Recall | None) -> list[StoredResponse]:
    """The chain to continue; a 400 if its last response has not finished
    (a background response still running) or did not succeed."""
    chain = recall(response_id) if recall is not None else None
    if chain is None:
        if recall is not None and not services().store_configured:
            raise previous_not_found(response_id)
        chain = await _load_chain(response_id)
    status = chain[-1].response.get("status")
    if status not in ("completed", "incomplete"):
        still = status in ("queued", "in_progress")
        raise invalid_request(
            f'previous response "{response_id}" '
            + (
                "has not finished yet: wait for it"
                if still
                else f"ended {status}: it cannot be continued"
            ),
            "previous_response_id",
        )
    return chain


def previous_not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f'Previous response "{response_id}" not found or expired',
        "not_found_error",
        param="previous_response_id",
        code="previous_response_not_found",
    )


async def _load_chain(response_id: str) -> list[StoredResponse]:
    store = open_store(
        f"cannot continue from response {response_id!r}",
        invalid_request(
            "previous_response_id requires a response store to be configured",
            "previous_response_id",
        ),
    )
    try:
        chain = await store.chain(response_id)
    except StoreError as exc:
        raise store_failure(exc, f"cannot read previous response {response_id!r}") from None
    if not chain or chain[-1].owner != client_domain():  # another key's: as if absent
        raise previous_not_found(response_id)
    return chain


def initial_response(turn: Turn, sampling: SamplingParams) -> ResponseObject:
    """The Response object's echo of the request, with the sampling values used."""
    request = turn.request
    text = request.text
    tool_choice = request.tool_choice if request.tool_choice is not None else "auto"
    return ResponseObject(
        model=request.model,
        instructions=turn.instructions,
        previous_response_id=request.previous_response_id,
        max_output_tokens=request.max_output_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        top_logprobs=request.top_logprobs or 0,
        tools=[_echo_tool(t) for t in request.tools],
        tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.wire(),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        reasoning={
            "effort": None,
            "summary": None,
            **(request.reasoning.wire() if request.reasoning is not None else {}),
        },
        text=TextConfig(
            format=text.format.wire() if text and text.format else {"type": "text"},
            verbosity=text.verbosity if text and text.verbosity else "medium",
        ),
        store=request.store is not False and services().store is not None,
        background=request.background is True,
        metadata=request.metadata.wire() if request.metadata is not None else {},
        prompt_cache_key=request.prompt_cache_key,
        safety_identifier=request.safety_identifier,
        user=request.user,
    )


def _echo_tool(tool: Tool) -> dict[str, Any]:
    if isinstance(tool, FunctionTool):
        return {"strict": True, "description": None, "parameters": None, **tool.wire()}
    return tool.wire()


def make_assembler(turn: Turn, response: ResponseObject, emit: Any = None) -> ResponseAssembler:
    seal = services().sealer.seal if turn.request.wants_sealed_reasoning else None
    return ResponseAssembler(response, emit, custom_tools=turn.request.custom_tool_names, seal=seal)


def stream_response(run: Run) -> Response:
    """The run as an SSE response; the producer lives in the call's nursery."""

    async def produce(sink: EventSink) -> None:
        assembler = make_assembler(run.turn, run.response, sink.send)
        await produce_events(run, assembler, lambda: stream.delivered)

    stream = responses_stream(produce)
    return sse_response(stream, run.cache.headers())


def responses_stream(produce: Producer) -> EventStream:
    """A Responses event stream run by ``produce`` in the call's nursery."""
    settings = services().settings
    return EventStream(
        request_nursery(),
        produce,
        RESPONSES,
        keepalive=settings.sse_keepalive,
        drain_timeout=settings.sse_drain_timeout,
    )


def sse_response(stream: EventStream, headers: dict[str, str]) -> Response:
    out = Response(stream.body(), status=200, headers={**SSE_HEADERS, **headers})
    out.timeout = None  # our drain deadline replaces Quart's 60 s response timeout
    return out
