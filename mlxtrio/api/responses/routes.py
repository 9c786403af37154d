"""``POST /v1/responses``: a turn as JSON or SSE (``background: true`` hands it
to ``background``; WebSocket mode is ``socket``; stored responses are served
by ``stored``).

Parse, build the turn (its chain read and checked), prepare, then stream or
answer whole. Everything that can fail because of the request (validation,
unknown model or previous response, tool order, context overflow, a full
waiting room) is answered as a JSON error *before* any byte of a stream.

Persistence is write-ahead-then-announce (``persist``); a turn the store could
not take is still delivered, and a later continuation from it gets a clear
404. Failed, cancelled and disconnected turns are never stored - except
background responses, whose clients poll for how they ended.
"""

from __future__ import annotations

from quart import Blueprint, Response

from ...http.delivery import tracked_json
from ...http.sse import EventSink
from ...http.transport import read_json_body
from ...serving.stream import produce
from ..validation import parse
from .background import start_background
from .generate import ResponseEvents, ResponseTurn, begin, make_assembler, sse_response
from .persist import persist, take_back_unless
from .requests import ResponsesRequest

blueprint = Blueprint("responses", __name__)


@blueprint.route("/v1/responses", methods=["POST"])
async def create_response() -> Response:
    request = parse(ResponsesRequest, await read_json_body())
    if request.background:
        return await start_background(request)
    run = await begin(request)
    if request.stream:
        return _stream(run)
    response = run.response
    assembler = make_assembler(run.turn, response)
    await assembler.complete(await run.prepared.complete(assembler.on_segment))
    stored = await persist(run.turn, response)
    out, delivery = tracked_json(response.wire())
    if stored:
        take_back_unless(lambda: delivery.delivered, response.id)
    out.headers.update(run.prepared.cache.headers())
    return out


def _stream(run: ResponseTurn) -> Response:
    """The turn as an SSE response; the producer lives in the call's nursery."""

    async def write(sink: EventSink) -> None:
        await produce(run.prepared, ResponseEvents(run, sink.send, lambda: stream.delivered))

    out, stream = sse_response(write, run.prepared.cache.headers())
    return out
