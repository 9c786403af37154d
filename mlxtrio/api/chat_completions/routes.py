"""``POST /v1/chat/completions`` (OpenAI Chat Completions), what most agents
and editors other than Claude Code and Codex speak (OpenCode, Aider,
Continue, Zed, Cline, LiteLLM, the ``openai`` SDK's default path).

Parse, convert, :func:`~mlxtrio.serving.pipeline.prepare`, then stream or
answer whole, as the other routes: validation, tool order, the context check
and a full waiting room are answered before any stream byte (OpenAI
envelope). Chat completions are not stored: the client resends the
conversation each turn, and the prefix cache makes that cheap.
"""

from __future__ import annotations

from quart import Blueprint, Response, jsonify

from ...http.errors import invalid_request
from ...http.sse import EventSink
from ...http.transport import read_json_body
from ...serving.pipeline import PreparedTurn, TurnRequest, prepare
from ...serving.stream import event_stream, produce
from ..validation import conversation_errors, parse
from .convert import custom_tool_names, to_conversation
from .events import DONE_FRAME, ENDING, ChatAssembler
from .requests import ChatCompletionRequest

blueprint = Blueprint("chat_completions", __name__)


@blueprint.route("/v1/chat/completions", methods=["POST"])
async def create_chat_completion() -> Response:
    request = parse(ChatCompletionRequest, await read_json_body())
    refused = request.unsupported()
    if refused is not None:
        raise invalid_request(f"{refused[0]}: {refused[1]}", refused[0])
    with conversation_errors():
        conversation = to_conversation(request)
    turn = await prepare(
        TurnRequest(
            request.model,
            conversation,
            request.sampling(),
            max_tokens=request.output_cap,
            stop_sequences=tuple(request.stop_sequences or ()),
            session=request.prompt_cache_key,
        )
    )
    custom = custom_tool_names(request)
    if request.stream:
        assembler = ChatAssembler(request.model, custom, include_usage=request.include_usage)
        return _stream(turn, assembler)
    assembler = ChatAssembler(request.model, custom)
    result = await turn.complete(assembler.on_segment)
    out = jsonify(assembler.completion(result))
    out.headers.update(turn.cache.headers())
    return out


def _stream(turn: PreparedTurn, assembler: ChatAssembler) -> Response:
    async def write(sink: EventSink) -> None:
        async def emit(chunk: dict[str, object]) -> None:
            await sink.send("", chunk)

        assembler.emit = emit
        await produce(turn, assembler)
        await sink.send_frame(DONE_FRAME, terminal=True)

    response, _ = event_stream(write, ENDING, turn.cache.headers())
    return response
