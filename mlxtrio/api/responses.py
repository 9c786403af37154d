"""``/v1/responses``: create (JSON or SSE), retrieve, delete, list input items.

Everything that can fail because of the request (validation, unknown model or
previous response, tool order, context overflow, a full waiting room) is answered
as a JSON error *before* any byte of a stream is sent.

Persistence is write-ahead-then-announce: a turn's record is committed before its
terminal event (or JSON body) goes out, so a client that continues the instant it
sees ``response.completed`` always finds it. A store that cannot write within
``store_write_timeout`` is logged and skipped - the client still gets its output,
and a later continuation from it gets a clear 404. Failed, cancelled and
disconnected turns are never stored - except background responses, whose
clients poll for how they ended (``responses_background``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from quart import Blueprint, Response, jsonify

from ..admission import Ticket
from ..chat.chain import check_delta, drop_echoed_calls, outstanding_calls, reconstruct
from ..chat.conversation import Conversation, Message
from ..chat.from_responses import map_items, offered_tools, required_tool
from ..chat.prompt import RenderedPrompt
from ..chat.tool_order import OPENAI, ToolOrderError, validate_tool_order
from ..chat.turn import OnSegment, TurnResult
from ..engine.engine import Engine
from ..engine.types import SamplingParams
from ..http.delivery import tracked_json
from ..http.errors import ApiError, invalid_request, not_found, unavailable
from ..http.sse import CLIENT_GONE, RESPONSES, SSE_HEADERS, EventSink, EventStream
from ..http.transport import client_domain, read_json_body
from ..protocol.openai_responses import (
    ResponseObject,
    TextConfig,
    input_item_resources,
    new_id,
)
from ..protocol.responses_items import InputItem
from ..protocol.responses_requests import FunctionTool, ResponsesRequest, Tool
from ..store import ResponseStore, StoredResponse, StoreError, StoreUnavailable
from .deps import on_request_end, request_nursery, resolve_engine, services
from .generation import (
    SHUTDOWN_MESSAGE,
    CacheLookup,
    generate,
    lookup,
    output_budget,
    render_prompt,
    reserve,
    tool_call_constraints,
)
from .responses_events import ResponseAssembler
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
        constraints=tool_call_constraints(turn.engine, turn.conversation, prompt),
    )
    continuation = request.previous_response_id is not None
    cache = lookup(turn.engine, prompt, cache_domain(request), continuation)
    ticket = reserve(turn.engine)
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
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type != "text":
        raise invalid_request(
            f'text.format type "{text_format.type}" (structured output) is not supported by this '
            'server yet; omit text.format or use {"type": "text"} and describe the wanted JSON '
            "in the prompt",
            "text.format",
        )
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
    conversation = Conversation(
        messages, offered_tools(request), request.thinking, required_tool(request)
    )
    return Turn(request, engine, conversation, delta, instructions, client_domain(), chain)


def _open_store(purpose: str, unconfigured: ApiError) -> ResponseStore:
    """The response store; ``unconfigured`` when the server has none, a 503
    when it has one that is not open (yet: it is retried in the background)."""
    svc = services()
    if svc.store is not None:
        return svc.store
    if svc.store_configured:
        raise ApiError(
            503,
            f"{purpose}: the response store is unavailable; retry later",
            "server_error",
            code="store_unavailable",
            headers={"Retry-After": "30"},
        )
    raise unconfigured


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
    store = _open_store(
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


def store_failure(exc: StoreError, doing: str) -> ApiError:
    """A clear 503 for a store that failed a read or a delete: the message says
    what failed, never how (the details, password-free, go to the log). Only a
    store that is down or busy is worth a retry."""
    log.error("%s: %s (%s)", doing, exc, exc.detail)
    retry = isinstance(exc, StoreUnavailable)
    return ApiError(
        503,
        f"{doing[0].upper()}{doing[1:]}: {exc}" + ("; retry later" if retry else ""),
        "server_error",
        code="store_unavailable",
        headers={"Retry-After": "5"} if retry else None,
    )


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


async def persist(turn: Turn, response: ResponseObject) -> bool:
    """Commit the turn before it is announced; never fail the client over it.
    Returns whether it was stored. A store that cannot write within
    ``store_write_timeout`` leaves nothing behind (the store guarantees it)."""
    svc = services()
    if svc.store is None or turn.request.store is False:
        return False
    record = record_of(turn, response)
    try:
        await svc.store.put(record, lock_wait=svc.settings.store_write_timeout)
    except StoreError as exc:
        log.error(
            "could not store response %s (the client still gets it): %s (%s)",
            response.id,
            exc,
            exc.detail,
        )
        return False
    return True


def record_of(turn: Turn, response: ResponseObject) -> StoredResponse:
    """The turn as the store keeps it (and as a WebSocket remembers it)."""
    svc = services()
    retention = turn.request.retention_seconds or svc.settings.response_retention
    return StoredResponse(
        id=response.id,
        previous_response_id=turn.request.previous_response_id,
        created_at=response.created_at,
        expires_at=int(time.time()) + retention,
        model=turn.request.model,
        status=response.status,
        instructions=turn.instructions,
        input_messages=[m.to_json() for m in turn.delta],
        input_items=input_items(turn.request.items),
        response=response.wire(),
        owner=turn.owner,
    )


def take_back_unless(delivered: Callable[[], bool], response_id: str) -> None:
    """When the request ends, delete the stored turn unless ``delivered()``: a
    client that left before the terminal event never saw the turn complete."""
    svc = services()  # the check runs after the request context is gone
    store = svc.store
    assert store is not None

    def check() -> None:
        if not delivered():
            svc.spawn(_take_back, store, response_id)

    on_request_end(check)


async def _take_back(store: ResponseStore, response_id: str) -> None:
    try:
        if await store.discard(response_id):
            log.info("response %s was not delivered (the client left); not kept", response_id)
    except StoreError as exc:
        log.error("could not take back undelivered response %s: %s", response_id, exc.detail)


def input_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """The request's input items as the input_items endpoint lists them (with ids)."""
    out = []
    for model in items:
        item = model.wire()
        item.setdefault("type", "message")
        if item["type"] == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if item["type"] == "message":
            item.setdefault("status", "completed")
        item.setdefault("id", new_id("msg" if item["type"] == "message" else "item"))
        out.append(item)
    return out


def stream_response(run: Run) -> Response:
    """The run as an SSE response; the producer lives in the call's nursery."""
    settings = services().settings

    async def produce(sink: EventSink) -> None:
        assembler = make_assembler(run.turn, run.response, sink.send)
        await produce_events(run, assembler, lambda: stream.delivered)

    stream = EventStream(
        request_nursery(),
        produce,
        RESPONSES,
        keepalive=settings.sse_keepalive,
        drain_timeout=settings.sse_drain_timeout,
    )
    return sse_response(stream, run.cache.headers())


def sse_response(stream: EventStream, headers: dict[str, str]) -> Response:
    out = Response(stream.body(), status=200, headers={**SSE_HEADERS, **headers})
    out.timeout = None  # our drain deadline replaces Quart's 60 s response timeout
    return out


# -- retrieval ------------------------------------------------------------------


async def _stored(response_id: str) -> StoredResponse:
    store = _open_store(
        f"cannot read response {response_id!r}",
        not_found(f'Response "{response_id}" not found: no response store is configured'),
    )
    try:
        record = await store.get(response_id)
    except StoreError as exc:
        raise store_failure(exc, f"cannot read response {response_id!r}") from None
    if record is None or record.owner != client_domain():  # another key's: as if absent
        raise not_found(f'Response "{response_id}" not found or expired')
    return record


@blueprint.route("/v1/responses/<response_id>", methods=["GET"])
async def retrieve_response(response_id: str) -> Response:
    """The stored response; a running background response as it stands now,
    or, with ``stream=true``, its events after ``starting_after``."""
    from quart import request

    from . import responses_background as background

    job = background.live_job(response_id)
    if request.args.get("stream", "false").lower() == "true":
        if job is None:
            await _stored(response_id)  # 404 if it does not exist at all
            raise invalid_request(
                "only background responses can be streamed again, while the server "
                "still holds their events (for a while after they end)",
                "stream",
            )
        return background.follow_job(job, _starting_after(request.args.get("starting_after")))
    if job is not None:  # what it is now (its stored copy may lag or have failed)
        return jsonify(job.snapshot())
    return jsonify(background.orphaned((await _stored(response_id)).response))


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    try:
        return max(-1, int(value))
    except ValueError:
        raise invalid_request("starting_after must be an integer", "starting_after") from None


@blueprint.route("/v1/responses/<response_id>/cancel", methods=["POST"])
async def cancel_response(response_id: str) -> Response:
    from . import responses_background as background

    job = background.live_job(response_id)
    stored = None if job is not None else (await _stored(response_id)).response
    return await background.cancel(response_id, stored)


@blueprint.route("/v1/responses/<response_id>", methods=["DELETE"])
async def delete_response(response_id: str) -> Response:
    from . import responses_background as background

    await _stored(response_id)
    await background.delete_job(response_id)  # its last write must not bring it back
    store = services().store
    assert store is not None
    try:
        await store.delete(response_id)
    except StoreError as exc:
        raise store_failure(exc, f"cannot delete response {response_id!r}") from None
    return jsonify({"id": response_id, "object": "response.deleted", "deleted": True})


@blueprint.route("/v1/responses/<response_id>/input_items", methods=["GET"])
async def list_input_items(response_id: str) -> Response:
    from quart import request

    record = await _stored(response_id)
    items = input_item_resources(list(record.input_items))
    if request.args.get("order", "desc") == "desc":
        items.reverse()
    after = request.args.get("after")
    if after:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    try:
        limit = max(1, min(100, int(request.args.get("limit", 20))))
    except ValueError:
        raise invalid_request("limit must be an integer between 1 and 100", "limit") from None
    page = items[:limit]
    return jsonify(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
