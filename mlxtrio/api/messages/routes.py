"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic).

Parse, convert, :func:`~mlxtrio.serving.pipeline.prepare`, then stream or
answer whole. Everything that is the request's fault (validation, unknown
model, tool order, context overflow, a full waiting room) is answered before
any stream byte; errors use the Anthropic envelope (the path decides).
"""

from __future__ import annotations

from quart import Blueprint, Response, jsonify

from ...chat.conversation import Conversation
from ...http.sse import EventSink
from ...http.transport import read_json_body
from ...serving.pipeline import PreparedTurn, TurnRequest, prepare, render_for_model
from ...serving.stream import event_stream, produce
from ..validation import conversation_errors, parse
from .convert import to_conversation
from .events import ENDING, PING, MessageAssembler
from .objects import MessageObject
from .requests import CountTokensRequest, MessagesRequest

blueprint = Blueprint("messages", __name__)


def _conversation(request: CountTokensRequest) -> Conversation:
    with conversation_errors():
        return to_conversation(request)


@blueprint.route("/v1/messages", methods=["POST"])
async def create_message() -> Response:
    request = parse(MessagesRequest, await read_json_body())
    turn = await prepare(
        TurnRequest(
            request.model,
            _conversation(request),
            request.sampling(),
            max_tokens=request.max_tokens,
            stop_sequences=tuple(request.stop_sequences or ()),
        )
    )
    message = MessageObject(model=request.model)
    if request.stream:
        return _stream(turn, message)
    assembler = MessageAssembler(message)
    await assembler.finish(await turn.complete(assembler.on_segment))
    out = jsonify(message.wire())
    out.headers.update(turn.cache.headers())
    return out


def _stream(turn: PreparedTurn, message: MessageObject) -> Response:
    async def write(sink: EventSink) -> None:
        events = MessageAssembler(
            message,
            sink.send,
            prompt_tokens=len(turn.prompt.tokens),
            cached_tokens=turn.cache.cached_tokens,
        )
        await produce(turn, events)

    response, _ = event_stream(write, ENDING, turn.cache.headers(), keepalive_frame=PING)
    return response


@blueprint.route("/v1/messages/count_tokens", methods=["POST"])
async def count_tokens() -> Response:
    """Exactly what generation would render: no engine work, no admission slot."""
    request = parse(CountTokensRequest, await read_json_body())
    _, prompt = await render_for_model(request.model, _conversation(request))
    return jsonify({"input_tokens": len(prompt.tokens)})
