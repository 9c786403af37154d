"""``/v1/responses``: create (JSON or SSE), retrieve, delete, list input items.

Everything that can fail because of the request (validation, unknown model or
previous response, tool order, context overflow, a full waiting room) is answered
as a JSON error *before* any byte of a stream is sent.

Persistence is write-ahead-then-announce: a turn's record is committed before its
terminal event (or JSON body) goes out, so a client that continues the instant it
sees ``response.completed`` always finds it. A store that cannot write within
``store_write_timeout`` is logged and skipped - the client still gets its output,
and a later continuation from it gets a clear 404. Failed, cancelled and
disconnected turns are never stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quart import Blueprint, Response, jsonify

from ..admission import Ticket
from ..chat.chain import check_delta, drop_echoed_calls, outstanding_calls, reconstruct
from ..chat.conversation import Conversation, Message
from ..chat.from_responses import map_items, offered_tools, required_tool
from ..chat.prompt import RenderedPrompt
from ..chat.tool_order import OPENAI, ToolOrderError, validate_tool_order
from ..engine.engine import Engine
from ..engine.types import SamplingParams
from ..http.delivery import tracked_json
from ..http.errors import ApiError, invalid_request, not_found, unavailable
from ..http.sse import CLIENT_GONE, RESPONSES, SSE_HEADERS, EventSink, EventStream
from ..http.transport import client_domain, read_json_body
from ..protocol.openai_responses import ResponseObject, TextConfig, new_id
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


@blueprint.route("/v1/responses", methods=["POST"])
async def create_response() -> Response:
    turn = await prepare(parse(ResponsesRequest, await read_json_body()))
    prompt = await render_prompt(turn.engine, turn.conversation)
    request = turn.request
    sampling = request.sampling_params(
        max_tokens=output_budget(request.max_output_tokens, turn.engine, prompt),
        constraints=tool_call_constraints(turn.engine, turn.conversation, prompt),
    )
    continuation = request.previous_response_id is not None
    cache = lookup(turn.engine, prompt, _cache_domain(request), continuation)
    ticket = reserve(turn.engine)
    response = initial_response(turn, sampling)
    if request.stream:
        return stream_response(turn, ticket, prompt, sampling, response, cache)
    assembler = make_assembler(turn, response)
    result = await generate(
        turn.engine, ticket, prompt, sampling, turn.conversation, assembler.on_segment, cache
    )
    if result.finish_reason == "cancelled":
        raise unavailable(SHUTDOWN_MESSAGE)
    await assembler.complete(result)
    stored = await persist(turn, response)
    out, delivery = tracked_json(response.wire())
    if stored:
        take_back_unless(lambda: delivery.delivered, response.id)
    out.headers.update(cache.headers())
    return out


def _cache_domain(request: ResponsesRequest) -> str:
    """``cache_salt`` isolates cached prefixes: requests share KV only within a salt."""
    return "" if request.cache_salt is None else "salt:" + request.cache_salt


async def prepare(request: ResponsesRequest) -> Turn:
    """Resolve the model and the chain, map and validate the input (spec §3.4)."""
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
    if request.previous_response_id is not None:
        chain = await _load_chain(request.previous_response_id)
        prior = reconstruct(chain)
        if request.instructions is None:
            instructions = chain[-1].instructions
    continuation = request.previous_response_id is not None
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
        raise invalid_request(
            "input is empty and there are no instructions: nothing to respond to", "input"
        )
    conversation = Conversation(
        messages, offered_tools(request), request.thinking, required_tool(request)
    )
    return Turn(request, engine, conversation, delta, instructions, client_domain())


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
        raise not_found(f'Previous response "{response_id}" not found or expired')
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
    now = int(time.time())
    retention = turn.request.retention_seconds or svc.settings.response_retention
    record = StoredResponse(
        id=response.id,
        previous_response_id=turn.request.previous_response_id,
        created_at=response.created_at,
        expires_at=now + retention,
        model=turn.request.model,
        status=response.status,
        instructions=turn.instructions,
        input_messages=[m.to_json() for m in turn.delta],
        input_items=input_items(turn.request.items),
        response=response.wire(),
        owner=turn.owner,
    )
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


def stream_response(
    turn: Turn,
    ticket: Ticket,
    prompt: RenderedPrompt,
    sampling: SamplingParams,
    response: ResponseObject,
    cache: CacheLookup,
) -> Response:
    settings = services().settings

    async def produce(sink: EventSink) -> None:
        assembler = make_assembler(turn, response, sink.send)
        try:
            await assembler.start()
            result = await generate(
                turn.engine,
                ticket,
                prompt,
                sampling,
                turn.conversation,
                assembler.on_segment,
                cache,
            )
            if result.finish_reason == "cancelled":  # only the server cancels a live stream
                await assembler.fail(SHUTDOWN_MESSAGE, code="server_shutting_down")
                return
            await assembler.complete(result)
            if await persist(turn, response):
                take_back_unless(lambda: stream.delivered, response.id)
            await assembler.announce()
        except ApiError as exc:
            await assembler.fail(exc.message)
        except CLIENT_GONE:
            raise
        except Exception:  # a bug: the stream still ends with its terminal event
            log.exception("response %s failed", response.id)
            await assembler.fail("internal server error")

    stream = EventStream(
        request_nursery(),
        produce,
        RESPONSES,
        keepalive=settings.sse_keepalive,
        drain_timeout=settings.sse_drain_timeout,
    )
    out = Response(stream.body(), status=200, headers={**SSE_HEADERS, **cache.headers()})
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
    return jsonify((await _stored(response_id)).response)


@blueprint.route("/v1/responses/<response_id>", methods=["DELETE"])
async def delete_response(response_id: str) -> Response:
    await _stored(response_id)
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
    items = list(record.input_items)
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
