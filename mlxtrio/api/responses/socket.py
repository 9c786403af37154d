"""WebSocket mode of ``/v1/responses`` (what Codex uses with
``supports_websockets = true``).

One connection carries many turns. Each turn starts with a ``response.create``
message whose body is the create request (``stream`` and ``background`` do not
apply: every event is sent as one JSON text message). Turns run one at a time:
a message that arrives while a turn runs waits for it.

The connection remembers its last response, so the next turn can continue it
with ``previous_response_id`` and only the new input, even with ``store:
false``; an unknown id is a ``previous_response_not_found`` error, and a turn
that fails forgets what was remembered (the client starts over with its full
input). Each turn is a call of its own: admission, the prefix cache, the store
and the access log work as for HTTP. Closing the socket cancels the running
turn: Quart cancels the handler, and the engine stops that sequence at its
next safepoint, as for an HTTP hang-up.

``generate: false`` warms the server up for a turn that is coming (Codex sends
it when a session starts): the prompt is prefilled (its KV is kept in the
prefix cache) and the response, with no output, can be continued like any
other. A turn that is silent for a while (queued, or prefilling a long prompt)
sends ``{"type": "keepalive"}`` messages. A client that stops reading is let
go as an SSE client is: once a message has waited ``sse_drain_timeout``
seconds to be queued for the socket, the turn is cancelled (its slot freed at
the engine's next safepoint) and the socket closes once its pending write
ends (hypercorn's writes cannot be interrupted: the client reads, or goes).
``response.processed`` messages (newer Codex versions) are ignored; other
message types get an error event and the connection stays open.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import trio
from quart import Blueprint, websocket

from ...http.access_log import AccessRecord
from ...http.errors import ApiError, invalid_request
from ...http.sse import CLIENT_GONE
from ...jsontext import loads
from ...serving.call import open_call_scope, services
from ...serving.stream import produce
from ...store import StoredResponse
from ..validation import parse
from .events import usage_of
from .generate import ResponseEvents, ResponseTurn, begin, make_assembler
from .persist import persist, record_of
from .requests import ResponsesRequest

log = logging.getLogger("mlxtrio.responses")

blueprint = Blueprint("responses_socket", __name__)

# Fields of the HTTP create body that mean nothing on a socket.
TRANSPORT_FIELDS = ("type", "stream", "stream_options", "background")


@dataclass
class Memory:
    """The connection's last response, as the chain that ends with it."""

    chain: list[StoredResponse] = field(default_factory=list)

    def recall(self, response_id: str) -> list[StoredResponse] | None:
        if self.chain and self.chain[-1].id == response_id:
            return self.chain
        return None

    def remember(self, chain: list[StoredResponse]) -> None:
        self.chain = chain

    def forget(self) -> None:
        self.chain = []


class ClientGone(trio.BrokenResourceError):
    """The client stopped reading, or its socket is broken: its turn ends."""


class Connection:
    """One client's socket: its memory, and the one way events go out.

    Events go out through a small queue that one writer task drains into the
    socket, in order. The turn never waits on the socket itself: hypercorn
    shields its socket writes from cancellation, so a turn blocked in one
    could not be stopped while the engine decoded on for a client that had
    stopped reading. While a turn is silent - queued, or prefilling a long
    prompt - a ``{"type": "keepalive"}`` message goes out every ``keepalive``
    seconds: Codex gives up on a turn after 5 minutes without a text message
    (protocol pings do not count) and skips message types it does not know."""

    def __init__(self, keepalive: float, drain_timeout: float, *, buffer: int = 16) -> None:
        self.memory = Memory()
        self._keepalive = keepalive
        self.drain_timeout = drain_timeout
        # Text messages, and flush() markers the writer sets when it reaches them.
        self._queue, self._outgoing = trio.open_memory_channel[str | trio.Event](buffer)
        self._last_sent = trio.current_time()
        self._stalled = False
        self._gone = False

    async def write(self) -> None:
        """Hand queued messages to the socket, for the connection's lifetime.

        Cancellation takes effect between messages only: while the socket
        cannot take one, this waits (shielded, in hypercorn) for the client to
        read or to go away. Once the socket is broken, what is queued is
        dropped and :meth:`send` and :meth:`flush` raise."""
        async for item in self._outgoing:
            if isinstance(item, trio.Event):
                item.set()
            elif not self._gone:
                try:
                    await websocket.send(item)
                except CLIENT_GONE:
                    self._gone = True

    async def send(self, data: dict[str, Any]) -> None:
        """Queue one event as one text message.

        Raises :class:`ClientGone` when the queue stayed full for
        ``drain_timeout`` seconds - the client stopped reading - and at once
        for every send after that one, or once the socket is broken."""
        await self._deliver(json.dumps(data, ensure_ascii=False, separators=(",", ":")))
        self._last_sent = trio.current_time()

    async def flush(self) -> None:
        """Wait until every message queued so far was handed to the socket.

        Raises as :meth:`send` does, the deadline counting from here."""
        await self._deliver(trio.Event())

    async def _deliver(self, item: str | trio.Event) -> None:
        """Queue ``item``; for a flush marker, also wait until the writer
        reaches it. Both within one drain deadline."""
        self._check()
        with trio.move_on_after(self.drain_timeout):
            await self._queue.send(item)
            if isinstance(item, trio.Event):
                await item.wait()
                self._check()
            return
        self._stalled = True
        raise ClientGone("the client stopped reading")

    def _check(self) -> None:
        if self._stalled:
            raise ClientGone("the client stopped reading")
        if self._gone:
            raise ClientGone("the client is gone")

    @property
    def stalled(self) -> bool:
        """Whether a send waited out the drain deadline."""
        return self._stalled

    async def keep_alive(self) -> None:
        """Run beside a turn (cancelled with it)."""
        if self._keepalive <= 0:
            return
        while True:
            await trio.sleep_until(self._last_sent + self._keepalive)
            if trio.current_time() - self._last_sent >= self._keepalive:
                await self.send(KEEPALIVE)


KEEPALIVE = {"type": "keepalive"}
SERVER_BUG = ApiError(500, "internal server error", "server_error")
# Sent by newer Codex versions after each response; nothing to do.
IGNORED_MESSAGES = frozenset({"response.processed"})


@blueprint.websocket("/v1/responses")
async def responses_socket() -> None:
    """Serve ``response.create`` messages until the client closes."""
    await websocket.accept()
    settings = services().settings
    connection = Connection(settings.sse_keepalive, settings.sse_drain_timeout)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection.write)
        await _serve(connection)
        nursery.cancel_scope.cancel()


async def _serve(connection: Connection) -> None:
    """Run the client's turns, one at a time, until it goes away."""
    while True:
        message = await websocket.receive()
        try:
            await _answer(message, connection)
        except Exception as exc:
            if not _client_gone(exc):
                raise
            if connection.stalled:
                log.warning(
                    "WebSocket client stopped reading for %.0f s; its turn is cancelled, "
                    "the socket closes once its pending write ends",
                    connection.drain_timeout,
                )
            return


async def _answer(message: str | bytes, connection: Connection) -> None:
    """One message: a turn, nothing, or an error event. Raises only
    :class:`ClientGone` (perhaps grouped)."""
    try:
        body = _create_body(message)
        if body is not None:
            await _turn(body, connection)
    except ApiError as exc:
        log.info("WebSocket turn refused: %s %s", exc.status, exc.message)
        connection.memory.forget()
        await connection.send(_error_event(exc))
    except Exception as exc:
        if _client_gone(exc):
            raise
        # A bug: this turn fails, the connection goes on.
        log.exception("WebSocket turn failed")
        connection.memory.forget()
        await connection.send(_error_event(SERVER_BUG))


def _client_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says only that the client is gone or stopped reading:
    the turn's send and the keepalive beside it may both find out, and the
    call's nursery then raises the two as a group."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(ClientGone)[1] is None
    return isinstance(exc, ClientGone)


async def _turn(body: dict[str, Any], connection: Connection) -> None:
    """One turn, as one call (its own access line: status 200, or the error's)."""
    record = AccessRecord("WS", "/v1/responses response.create")
    async with open_call_scope(services(), record) as call:
        call.nursery.start_soon(connection.keep_alive)
        try:
            await _respond(body, connection)
        except ApiError as exc:
            record.status = exc.status
            raise
        record.status = 200


async def _respond(body: dict[str, Any], connection: Connection) -> None:
    memory = connection.memory
    generate = body.pop("generate", True)
    request = parse(ResponsesRequest, body)
    run = await begin(request, memory.recall, warm_up=generate is False)
    if generate is False:
        await _warm_up(run, connection)
    else:
        await _generate(run, connection)
    if run.response.status in ("completed", "incomplete"):
        memory.remember([*run.turn.chain, record_of(run.turn, run.response)])
    else:
        memory.forget()


async def _generate(run: ResponseTurn, connection: Connection) -> None:
    """Stream the turn's events, one message each."""
    delivered = False

    async def send(event: str, data: dict[str, Any]) -> None:
        await connection.send(data)

    await produce(run.prepared, ResponseEvents(run, send, lambda: delivered))
    await connection.flush()
    delivered = True


async def _warm_up(run: ResponseTurn, connection: Connection) -> None:
    """Prefill the prompt (one token is generated and thrown away) so that
    the turn that follows finds its KV cached; answer with a completed
    response that has no output.

    A warm-up with no messages at all (Codex's first one: tools only) is
    answered without prefilling: chat templates put the system and developer
    messages ahead of the tools, so the next turn's prompt would part from
    it within a few tokens and the work would be lost."""
    response = run.response
    if run.turn.has_a_prompt_of_its_own:
        prepared = run.prepared
        prepared.sampling = replace(prepared.sampling, max_tokens=1, constraints=())
        result = await prepared.complete(make_assembler(run.turn, response).on_segment)
        response.usage = usage_of(result)
    response.status = "completed"
    response.completed_at = int(time.time())
    response.output, response.output_text = [], ""
    await persist(run.turn, response)
    for number, kind in enumerate(("response.created", "response.completed")):
        await connection.send(
            {"type": kind, "sequence_number": number, "response": response.wire()}
        )


def _create_body(message: str | bytes) -> dict[str, Any] | None:
    """The create request inside a ``response.create`` message; None for a
    message that needs no answer; a 400 for anything else."""
    try:
        body = loads(message)
    except ValueError:
        raise invalid_request("the message is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid_request("a message must be a JSON object")
    kind = body.get("type")
    if not isinstance(kind, str):
        raise invalid_request('a message needs a string "type" (response.create)', "type")
    if kind in IGNORED_MESSAGES:
        return None
    if kind != "response.create":
        raise invalid_request(
            f"unsupported message type {kind!r}: this server accepts response.create", "type"
        )
    return {k: v for k, v in body.items() if k not in TRANSPORT_FIELDS}


def _error_event(exc: ApiError) -> dict[str, Any]:
    return {
        "type": "error",
        "status": exc.status,
        "error": {
            "type": exc.type,
            "code": exc.code,
            "message": exc.message,
            "param": exc.param,
        },
    }
