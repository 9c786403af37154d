"""``POST /v1/responses``: parse, validate, admit, generate, render.

Everything that can fail because of the request (validation, unknown model,
context overflow, a full waiting room) is answered as a JSON error *before* any
byte of a stream is sent.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Blueprint, Response, jsonify

from ..admission import Ticket
from ..chat.conversation import Conversation
from ..chat.from_responses import ResponsesRequest, parse_request, to_conversation
from ..chat.prompt import RenderedPrompt
from ..engine.engine import Engine
from ..engine.types import SamplingParams
from ..http.errors import ApiError, unavailable
from ..http.sse import SSE_HEADERS, EventSink, EventStream
from ..http.transport import read_json_body
from ..protocol.openai_responses import ResponseObject, TextConfig
from .deps import request_nursery, resolve_engine, services
from .generation import SHUTDOWN_MESSAGE, generate, output_budget, render_prompt, reserve
from .responses_events import ResponseAssembler

log = logging.getLogger("mlxtrio.responses")

blueprint = Blueprint("responses", __name__)


@blueprint.route("/v1/responses", methods=["POST"])
async def create_response() -> Response:
    request = parse_request(await read_json_body())
    engine = resolve_engine(request.model)
    conversation = to_conversation(request)
    prompt = await render_prompt(engine, conversation)
    sampling = SamplingParams(
        temperature=request.temperature if request.temperature is not None else 0.0,
        top_p=request.top_p if request.top_p is not None else 1.0,
        max_tokens=output_budget(request.max_output_tokens, engine, prompt),
        seed=request.body.get("seed") if isinstance(request.body.get("seed"), int) else None,
    )
    ticket = reserve(engine)
    response = initial_response(request)
    if request.stream:
        return stream_response(engine, ticket, prompt, sampling, conversation, response)
    assembler = ResponseAssembler(response)
    result = await generate(engine, ticket, prompt, sampling, conversation, assembler.on_segment)
    if result.finish_reason == "cancelled":
        raise unavailable(SHUTDOWN_MESSAGE)
    await assembler.finish(result)
    return jsonify(response.wire())


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
            result = await generate(
                engine, ticket, prompt, sampling, conversation, assembler.on_segment
            )
        except ApiError as exc:
            await assembler.fail(exc.message)
            return
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
