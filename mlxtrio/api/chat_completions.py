"""``POST /v1/chat/completions`` (OpenAI Chat Completions), what most agents
and editors other than Claude Code and Codex speak (OpenCode, Aider,
Continue, Zed, Cline, LiteLLM, the ``openai`` SDK's default path).

The same steps as the other routes: validation, tool order, the context check
and a full waiting room are answered before any stream byte (OpenAI
envelope); the turn takes an admission place, starts from the longest cached
prefix, and stops at the next engine step when the client hangs up. Chat
completions are not stored: the client resends the conversation each turn,
and the prefix cache makes that cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

from quart import Blueprint, Response, jsonify

from ..chat.from_chat import custom_tool_names, to_conversation
from ..chat.tool_order import CHAT, ToolOrderError, validate_tool_order
from ..chat.turn import OnSegment, TurnResult
from ..http.errors import ApiError, invalid_request, unavailable
from ..http.sse import CHAT as CHAT_STREAM
from ..http.sse import CLIENT_GONE, SSE_HEADERS, EventSink, EventStream
from ..http.transport import read_json_body
from ..protocol.chat_requests import ChatCompletionRequest
from .chat_events import ChatAssembler
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
from .validation import conversation_errors, parse

log = logging.getLogger("mlxtrio.chat")

blueprint = Blueprint("chat_completions", __name__)

Run = Callable[[OnSegment], Awaitable[TurnResult]]


@blueprint.route("/v1/chat/completions", methods=["POST"])
async def create_chat_completion() -> Response:
    request = parse(ChatCompletionRequest, await read_json_body())
    refused = request.unsupported()
    if refused is not None:
        raise invalid_request(f"{refused[0]}: {refused[1]}", refused[0])
    with conversation_errors():
        conversation = to_conversation(request)
    try:
        validate_tool_order(conversation.messages, CHAT)
    except ToolOrderError as exc:
        raise invalid_request(str(exc), "messages") from None
    engine = resolve_engine(request.model)
    prompt = await render_prompt(engine, conversation)
    sampling = request.sampling_params(
        max_tokens=output_budget(request.output_cap, engine, prompt),
        constraints=await output_constraints(engine, conversation, prompt),
    )
    ticket = reserve(engine)
    cache = await lookup(engine, prompt)
    run: Run = partial(
        generate,
        engine,
        ticket,
        prompt,
        sampling,
        conversation,
        cache=cache,
        stop_sequences=request.stop_sequences,
    )
    custom = custom_tool_names(request)
    if request.stream:
        assembler = ChatAssembler(request.model, custom, include_usage=request.include_usage)
        return _stream(run, assembler, cache)
    assembler = ChatAssembler(request.model, custom)
    result = await run(assembler.on_segment)
    if result.finish_reason == "cancelled":
        raise unavailable(SHUTDOWN_MESSAGE)
    out = jsonify(assembler.completion(result))
    out.headers.update(cache.headers())
    return out


def _stream(run: Run, assembler: ChatAssembler, cache: CacheLookup) -> Response:
    settings = services().settings

    async def produce(sink: EventSink) -> None:
        async def emit(chunk: dict[str, object]) -> None:
            await sink.send("", chunk)

        assembler.emit = emit
        try:
            await assembler.start()
            result = await run(assembler.on_segment)
            if result.finish_reason == "cancelled":
                await assembler.fail(SHUTDOWN_MESSAGE, kind="server_shutting_down")
            else:
                await assembler.finish(result)
        except ApiError as exc:
            await assembler.fail(exc.message, exc.type)
        except CLIENT_GONE:
            raise
        except Exception:  # a bug: the stream still ends with its error chunk
            log.exception("chat completion %s failed", assembler.id)
            await assembler.fail("internal server error")
        await sink.send_done()

    stream = EventStream(
        request_nursery(),
        produce,
        CHAT_STREAM,
        keepalive=settings.sse_keepalive,
        drain_timeout=settings.sse_drain_timeout,
    )
    out = Response(stream.body(), status=200, headers={**SSE_HEADERS, **cache.headers()})
    out.timeout = None
    return out
