"""``POST /v1/responses``: parse, validate, admit, generate, render.

Everything that can fail because of the request (validation, unknown model,
context overflow, a full waiting room) is answered as a JSON error *before* any
byte of a stream is sent.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Blueprint, Response, jsonify

from ..admission import QueueFull, Ticket
from ..chat.conversation import Conversation
from ..chat.from_responses import ResponsesRequest, parse_request, to_conversation
from ..chat.prompt import PromptError, RenderedPrompt, render
from ..chat.turn import TurnResult, run_turn
from ..engine.engine import Engine
from ..engine.handle import EngineError
from ..engine.types import SamplingParams
from ..http.errors import ApiError, invalid_request, rate_limited, server_error, unavailable
from ..http.sse import SSE_HEADERS, EventSink, EventStream
from ..http.transport import read_json_body
from ..protocol.openai_responses import ResponseObject, TextConfig
from .deps import on_request_end, request_nursery, resolve_engine, services
from .responses_events import ResponseAssembler

log = logging.getLogger("mlxtrio.responses")

blueprint = Blueprint("responses", __name__)

SHUTDOWN_MESSAGE = "generation was cancelled because the server is shutting down; retry"


@blueprint.route("/v1/responses", methods=["POST"])
async def create_response() -> Response:
    request = parse_request(await read_json_body())
    engine = resolve_engine(request.model)
    conversation = to_conversation(request)
    prompt = await render_prompt(engine, conversation)
    sampling = sampling_for(request, engine, prompt)
    ticket = reserve(engine)
    response = initial_response(request)
    if request.stream:
        return stream_response(engine, ticket, prompt, sampling, conversation, response)
    try:
        assembler = ResponseAssembler(response)
        result = await generate(engine, ticket, prompt, sampling, conversation, assembler)
    finally:
        ticket.release()
    if result.finish_reason == "cancelled":
        raise unavailable(SHUTDOWN_MESSAGE)
    await assembler.finish(result)
    return jsonify(response.wire())


async def render_prompt(engine: Engine, conversation: Conversation) -> RenderedPrompt:
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


def sampling_for(
    request: ResponsesRequest, engine: Engine, prompt: RenderedPrompt
) -> SamplingParams:
    settings = services().settings
    wanted = request.max_output_tokens or settings.default_max_tokens
    room = engine.context_length - len(prompt.tokens)
    return SamplingParams(
        temperature=request.temperature if request.temperature is not None else 0.0,
        top_p=request.top_p if request.top_p is not None else 1.0,
        max_tokens=max(1, min(wanted, settings.max_output_tokens, room)),
        seed=request.body.get("seed") if isinstance(request.body.get("seed"), int) else None,
    )


def reserve(engine: Engine) -> Ticket:
    """A place in the model's admission lane, released when the request ends."""
    try:
        ticket = services().lanes[engine.name].reserve()
    except QueueFull as exc:
        raise rate_limited(str(exc), exc.retry_after) from None
    on_request_end(ticket.release)
    return ticket


def initial_response(request: ResponsesRequest) -> ResponseObject:
    body = request.body
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return ResponseObject(
        model=request.model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=[_echo_tool(t) for t in request.tools],
        tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        reasoning={"effort": None, "summary": None, **(request.reasoning or {})},
        text=TextConfig(**{"verbosity": "medium", **text}),
        store=body.get("store") is not False,
        metadata=body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        prompt_cache_key=body.get("prompt_cache_key")
        if isinstance(body.get("prompt_cache_key"), str)
        else None,
        user=body.get("user") if isinstance(body.get("user"), str) else None,
    )


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") == "function":
        return {"strict": True, "description": None, "parameters": None, **tool}
    return tool


async def generate(
    engine: Engine,
    ticket: Ticket,
    prompt: RenderedPrompt,
    sampling: SamplingParams,
    conversation: Conversation,
    assembler: ResponseAssembler,
) -> TurnResult:
    tools = [t.template_dict() for t in conversation.tools] or None
    try:
        result = await run_turn(engine, ticket, prompt, sampling, assembler.on_segment, tools)
    except EngineError as exc:
        raise server_error(f"generation failed: {exc}") from None
    if result.stats.time_to_first_token is not None:
        services().metrics.ttft.labels(engine.name).observe(result.stats.time_to_first_token)
    return result


def stream_response(
    engine: Engine,
    ticket: Ticket,
    prompt: RenderedPrompt,
    sampling: SamplingParams,
    conversation: Conversation,
    response: ResponseObject,
) -> Response:
    settings = services().settings

    async def produce(sink: EventSink) -> None:
        assembler = ResponseAssembler(response, sink.send)
        await assembler.start()
        try:
            result = await generate(engine, ticket, prompt, sampling, conversation, assembler)
        except ApiError as exc:
            await assembler.fail(exc.message)
            return
        finally:
            ticket.release()
        if result.finish_reason == "cancelled":  # only the server cancels a live stream
            await assembler.fail(SHUTDOWN_MESSAGE, code="server_shutting_down")
            return
        await assembler.finish(result)

    stream = EventStream(
        request_nursery(),
        produce,
        keepalive=settings.sse_keepalive,
        drain_timeout=settings.sse_drain_timeout,
    )
    out = Response(stream.body(), status=200, headers=SSE_HEADERS)
    out.timeout = None  # our drain deadline replaces Quart's 60 s response timeout
    return out
