"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic).

Validation, model resolution, tool order and the context check all happen before
any stream byte; errors use the Anthropic envelope (the path decides).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

from quart import Blueprint, Response, jsonify

from ..chat.conversation import Conversation
from ..chat.from_anthropic import to_conversation
from ..chat.prompt import RenderedPrompt
from ..chat.tool_order import ANTHROPIC, ToolOrderError, validate_tool_order
from ..chat.turn import OnSegment, TurnResult
from ..engine.engine import Engine
from ..http.errors import ApiError, invalid_request, unavailable
from ..http.sse import (
    ANTHROPIC_PING,
    CLIENT_GONE,
    MESSAGES,
    SSE_HEADERS,
    EventSink,
    EventStream,
)
from ..http.transport import read_json_body
from ..protocol.anthropic import MessageObject
from ..protocol.anthropic_requests import CountTokensRequest, MessagesRequest
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
from .messages_events import MessageAssembler
from .validation import conversation_errors, parse

log = logging.getLogger("mlxtrio.messages")

blueprint = Blueprint("messages", __name__)

# generate() with everything but the segment callback bound.
Run = Callable[[OnSegment], Awaitable[TurnResult]]


async def _prepare(request: CountTokensRequest) -> tuple[Conversation, Engine, RenderedPrompt]:
    with conversation_errors():
        conversation = to_conversation(request)
    try:
        validate_tool_order(conversation.messages, ANTHROPIC)
    except ToolOrderError as exc:
        raise invalid_request(str(exc)) from None
    engine = resolve_engine(request.model)
    prompt = await render_prompt(engine, conversation)
    return conversation, engine, prompt


@blueprint.route("/v1/messages", methods=["POST"])
async def create_message() -> Response:
    request = parse(MessagesRequest, await read_json_body())
    conversation, engine, prompt = await _prepare(request)
    sampling = request.sampling_params(
        max_tokens=output_budget(request.max_tokens, engine, prompt),
        constraints=await output_constraints(engine, conversation, prompt),
        starts_in_reasoning=prompt.starts_in_reasoning,
    )
    # The place first: a request that waits for an in-flight prefill (or
    # reads blocks from disk) holds its place in the queue meanwhile.
    ticket = reserve(engine)
    cache = await lookup(engine, prompt)
    message = MessageObject(model=request.model)
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
    if request.stream:
        return _stream(run, prompt, message, cache)
    assembler = MessageAssembler(message)
    result = await run(assembler.on_segment)
    if result.finish_reason == "cancelled":
        raise unavailable(SHUTDOWN_MESSAGE)
    await assembler.finish(result)
    out = jsonify(message.wire())
    out.headers.update(cache.headers())
    return out


def _stream(
    run: Run, prompt: RenderedPrompt, message: MessageObject, cache: CacheLookup
) -> Response:
    settings = services().settings

    async def produce(sink: EventSink) -> None:
        assembler = MessageAssembler(message, sink.send)
        try:
            await assembler.start(len(prompt.tokens), cached_tokens=cache.cached_tokens)
            result = await run(assembler.on_segment)
            if result.finish_reason == "cancelled":
                await assembler.fail(SHUTDOWN_MESSAGE, kind="overloaded_error")
                return
            await assembler.finish(result)
        except ApiError as exc:
            await assembler.fail(exc.message)
        except CLIENT_GONE:
            raise
        except Exception:  # a bug: the stream still ends with its error event
            log.exception("message %s failed", message.id)
            await assembler.fail("internal server error")

    stream = EventStream(
        request_nursery(),
        produce,
        MESSAGES,
        keepalive=settings.sse_keepalive,
        drain_timeout=settings.sse_drain_timeout,
        keepalive_frame=ANTHROPIC_PING,
    )
    out = Response(stream.body(), status=200, headers={**SSE_HEADERS, **cache.headers()})
    out.timeout = None
    return out


@blueprint.route("/v1/messages/count_tokens", methods=["POST"])
async def count_tokens() -> Response:
    """Exactly what generation would render: no engine work, no admission slot."""
    _, _, prompt = await _prepare(parse(CountTokensRequest, await read_json_body()))
    return jsonify({"input_tokens": len(prompt.tokens)})
