"""WebSocket mode of /v1/responses, driven by the official openai SDK's
``responses.connect()`` (its sync client, in a worker thread: the SDK's
WebSocket client is not Trio's) against the real server and scripted model."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import openai
import pytest
import trio
from websockets.client import ClientProtocol
from websockets.exceptions import InvalidStatus
from websockets.protocol import State
from websockets.uri import parse_uri

from .conftest import SCRIPTED, Server, wait_until
from .schemas import OPENAI, load

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}

Events = list[dict[str, Any]]


def _turn(connection: Any, **create: Any) -> Events:
    """Send one response.create and read its events up to the terminal one."""
    connection.response.create(**create)
    events: Events = []
    for event in connection:
        events.append(event.to_dict())
        if event.type in TERMINAL:
            return events
    raise AssertionError("the socket closed before the turn ended")


async def _session(server: Server, script: Callable[[Any], Any], **client: Any) -> Any:
    def run() -> Any:
        sdk = openai.OpenAI(base_url=server.url + "/v1", max_retries=0, **client)
        with sdk.responses.connect(max_retries=0) as connection:
            return script(connection)

    return await trio.to_thread.run_sync(run)


def _conforms(*turns: Events) -> None:
    """Every event validates against both published documents; errors (a
    socket's own shape, with an HTTP status) against OpenAI's ResponseWsError."""
    schemas = load()
    for events in turns:
        for event in events:
            if event["type"] == "error":
                problems = schemas.problems(OPENAI, "ResponseWsError", event)
            else:
                problems = schemas.check_event(event)
            assert not problems, "\n".join(map(str, problems))


def _final(events: Events) -> dict[str, Any]:
    assert events[-1]["type"] == "response.completed", events[-1]
    return events[-1]["response"]


async def test_tool_round_trip_continues_on_the_socket_without_the_store(
    scripted: Server,
) -> None:
    def script(connection: Any) -> tuple[Events, Events]:
        first = _turn(
            connection, model=SCRIPTED, input="Weather?", tools=[WEATHER_TOOL], store=False
        )
        call = next(i for i in _final(first)["output"] if i["type"] == "function_call")
        second = _turn(
            connection,
            model=SCRIPTED,
            previous_response_id=_final(first)["id"],
            input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sun"}],
            tools=[WEATHER_TOOL],
            store=False,
        )
        return first, second

    first, second = await _session(scripted, script, api_key="unused")
    _conforms(first, second)
    call = next(i for i in _final(first)["output"] if i["type"] == "function_call")
    assert call["name"] == "get_weather" and '"Paris"' in call["arguments"]
    assert [e["sequence_number"] for e in first] == list(range(len(first)))
    done = _final(second)
    assert done["output_text"] == "It is sunny."
    assert done["previous_response_id"] == _final(first)["id"]
    # The continuation reused the first turn's KV: only its new input was prefilled.
    usage = done["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > usage["input_tokens"] // 2
    assert await scripted.services.store.get(done["id"]) is None  # store: false


async def test_unknown_previous_response_and_failed_turns_forget(scripted: Server) -> None:
    def script(connection: Any) -> list[Events]:
        ok = _turn(connection, model=SCRIPTED, input="Hi!", store=False)
        unknown = _turn(connection, model=SCRIPTED, input="Hi", previous_response_id="resp_x")
        # The failed turn evicted the remembered response: it cannot be continued.
        after = _turn(
            connection,
            model=SCRIPTED,
            input="Again",
            previous_response_id=_final(ok)["id"],
            store=False,
        )
        bad = _turn(connection, model=SCRIPTED, input="Hi", temperature=7)
        return [ok, unknown, after, bad]

    ok, unknown, after, bad = await _session(scripted, script, api_key="unused")
    _conforms(ok, unknown, after, bad)
    assert _final(ok)["output_text"] == "Hello world."
    for events in (unknown, after):
        assert events[-1]["type"] == "error"
        assert events[-1]["error"]["code"] == "previous_response_not_found"
        assert events[-1]["error"]["param"] == "previous_response_id"
        assert events[-1]["status"] == 404
    assert bad[-1]["type"] == "error" and bad[-1]["status"] == 400
    assert bad[-1]["error"]["param"] == "temperature"


async def test_stored_responses_continue_across_connections(scripted: Server) -> None:
    first = await _session(
        scripted, lambda c: _turn(c, model=SCRIPTED, input="Hi!"), api_key="unused"
    )
    second = await _session(
        scripted,
        lambda c: _turn(c, model=SCRIPTED, input="More", previous_response_id=_final(first)["id"]),
        api_key="unused",
    )
    assert _final(second)["previous_response_id"] == _final(first)["id"]


async def test_warm_up_prefills_without_output(scripted: Server) -> None:
    """A warm-up with the instructions and tools, then the first real turn
    continuing it with its input; a warm-up with nothing but tools (how Codex
    starts a session) is answered at once."""

    def script(connection: Any) -> tuple[Events, Events]:
        empty = _turn(connection, model=SCRIPTED, input=[], tools=[WEATHER_TOOL], generate=False)
        assert _final(empty)["usage"]["input_tokens"] == 0
        warm = _turn(
            connection,
            model=SCRIPTED,
            instructions="You are a weather bot.",
            input=[],
            tools=[WEATHER_TOOL],
            generate=False,
            store=False,
        )
        real = _turn(
            connection,
            model=SCRIPTED,
            input="Weather?",
            instructions="You are a weather bot.",
            tools=[WEATHER_TOOL],
            previous_response_id=_final(warm)["id"],
            store=False,
        )
        return warm, real

    warm, real = await _session(scripted, script, api_key="unused")
    _conforms(warm, real)
    assert [e["type"] for e in warm] == ["response.created", "response.completed"]
    assert _final(warm)["output"] == []
    done = _final(real)
    assert [i["type"] for i in done["output"]][-1] == "function_call"
    assert done["usage"]["input_tokens_details"]["cached_tokens"] > 0


async def test_a_tools_only_warm_up_is_not_taken_for_a_cached_turn(
    scripted: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Codex's first warm-up (tools only) is not prefilled, so the real turn
    after it is a new conversation to the cache watch, not a divergence from a
    turn that was never cached (seen with gpt-oss: "reused 0 of 16650 ...
    parted from the session's previous turn at token 286")."""
    caplog.set_level(logging.INFO, "mlxtrio")

    def script(connection: Any) -> Events:
        session = {"model": SCRIPTED, "tools": [WEATHER_TOOL], "prompt_cache_key": "thread-1"}
        _turn(connection, input=[], generate=False, **session)
        messages = [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
        ]
        return _turn(connection, input=messages, **session)

    await _session(scripted, script, api_key="unused")

    def turns() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "mlxtrio.access" and "response.create" in r.getMessage()
        ]

    await wait_until(lambda: len(turns()) == 2, what="both turns' access lines")
    assert "miss=new_conversation" in turns()[1]
    assert not [r for r in caplog.records if "parted from" in r.getMessage()]


async def test_a_warm_up_can_be_followed_by_a_whole_history(scripted: Server) -> None:
    """Codex resuming a session: warm-up, then the full history (its tool
    calls and results included) continuing the warm-up."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather"}
    history = [
        {"role": "user", "content": "Weather?"},
        {**call, "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sun"},
    ]

    def script(connection: Any) -> Events:
        warm = _turn(connection, model=SCRIPTED, input=[], tools=[WEATHER_TOOL], generate=False)
        return _turn(
            connection,
            model=SCRIPTED,
            input=history,
            tools=[WEATHER_TOOL],
            previous_response_id=_final(warm)["id"],
        )

    events = await _session(scripted, script, api_key="unused")
    assert _final(events)["output_text"] == "It is sunny."


async def test_closing_the_socket_stops_generation(scripted: Server) -> None:
    engine = scripted.engine

    def script(connection: Any) -> str:
        connection.response.create(model=SCRIPTED, input="LOOP forever", max_output_tokens=4000)
        for event in connection:
            if event.type == "response.output_text.delta":
                return "generating"  # leaving the block closes the socket
        return "closed"

    assert await _session(scripted, script, api_key="unused") == "generating"
    await wait_until(lambda: engine.active_sequences == 0, what="slot freed after close")


async def test_unsupported_messages_get_an_error_event(scripted: Server) -> None:
    def script(connection: Any) -> Events:
        connection.send({"type": "response.steer", "input": [], "previous_response_id": "r"})
        return [next(iter(connection)).to_dict()]

    (event,) = await _session(scripted, script, api_key="unused")
    assert event["type"] == "error" and event["status"] == 400
    assert "response.create" in event["error"]["message"]


async def test_the_handshake_needs_the_api_key(server_factory, scripted_model_path) -> None:
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, api_key="sekret")
    with pytest.raises(InvalidStatus) as refused:
        await _session(server, lambda c: None, api_key="wrong")
    assert refused.value.response.status_code == 401
    events = await _session(
        server, lambda c: _turn(c, model=SCRIPTED, input="Hi!"), api_key="sekret"
    )
    assert _final(events)["output_text"] == "Hello world."


async def test_a_silent_turn_sends_keepalives_and_processed_is_ignored(
    server_factory, scripted_model_path
) -> None:
    """One slot: a turn queued behind another hears keepalives while it waits."""
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, sse_keepalive=0.2
    )
    engine = server.engine

    def hog(connection: Any) -> None:  # holds the slot for 4,000 tokens
        connection.response.create(model=SCRIPTED, input="LOOP", max_output_tokens=4000)
        for event in connection:
            if event.type in ("response.completed", "response.incomplete"):
                return

    def waiter(connection: Any) -> Events:
        connection.send({"type": "response.processed", "response_id": "resp_x"})
        return _turn(connection, model=SCRIPTED, input="Hi!")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(_session, server, hog, api_key="unused"))
        await wait_until(lambda: engine.active_sequences == 1, what="slot taken")
        events = await _session(server, waiter, api_key="unused")
    types = [e["type"] for e in events]
    assert "keepalive" in types
    assert types[-1] == "response.completed"
    assert _final(events)["output_text"] == "Hello world."


async def test_the_socket_survives_bad_messages_and_remembers_stored_chains(
    scripted: Server,
) -> None:
    """A malformed message is an error event, not a closed socket; a turn that
    continues a stored response remembers the whole chain, not itself alone."""
    first = await _session(
        scripted, lambda c: _turn(c, model=SCRIPTED, input="Hi!"), api_key="unused"
    )

    def script(connection: Any) -> tuple[Events, Events, Events]:
        connection.send({"type": ["x"]})
        bad = [next(iter(connection)).to_dict()]
        second = _turn(
            connection, model=SCRIPTED, input="More", previous_response_id=_final(first)["id"]
        )
        third = _turn(
            connection,
            model=SCRIPTED,
            input="Again",
            previous_response_id=_final(second)["id"],
            store=False,
        )
        return bad, second, third

    bad, second, third = await _session(scripted, script, api_key="unused")
    assert bad[0]["type"] == "error" and bad[0]["status"] == 400
    # The third turn's prompt holds all three user messages: it grew past the second's.
    assert _final(third)["usage"]["input_tokens"] > _final(second)["usage"]["input_tokens"]
    async with scripted.client() as http:
        counted = await http.post(
            "/v1/responses/input_tokens",
            json={
                "model": SCRIPTED,
                "input": "Again",
                "previous_response_id": _final(second)["id"],
            },
        )
    assert counted.json()["input_tokens"] == _final(third)["usage"]["input_tokens"]


async def test_a_warm_up_generates_one_token_at_most(scripted: Server) -> None:
    events = await _session(
        scripted,
        lambda c: _turn(c, model=SCRIPTED, instructions="Be brief.", input="LOOP", generate=False),
        api_key="unused",
    )
    assert _final(events)["usage"]["output_tokens"] <= 1


async def test_a_client_that_stops_reading_is_let_go_after_the_drain_deadline(
    server_factory, scripted_model_path
) -> None:
    """As for an SSE stream: a turn whose messages wait ``sse_drain_timeout``
    to be taken (the client stopped reading, the socket's buffers are full) is
    cancelled, and its slot freed, instead of decoding for no one."""
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, sse_drain_timeout=1
    )
    protocol = ClientProtocol(parse_uri(f"ws://{server.host}:{server.port}/v1/responses"))
    # A small receive buffer, so that the server's sends back up within seconds.
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
    await sock.connect((server.host, server.port))
    stream = trio.SocketStream(sock)
    received = b""

    async def read_until(marker: bytes) -> None:
        nonlocal received
        with trio.fail_after(30):
            while marker not in received:
                received += await stream.receive_some(65536)

    try:
        protocol.send_request(protocol.connect())
        await stream.send_all(b"".join(protocol.data_to_send()))
        await read_until(b"\r\n\r\n")
        protocol.receive_data(received)
        assert protocol.state is State.OPEN, received
        create = {"type": "response.create", "model": SCRIPTED, "input": "LOOP"}
        protocol.send_text(json.dumps({**create, "max_output_tokens": 10**9}).encode())
        await stream.send_all(b"".join(protocol.data_to_send()))
        await read_until(b"response.output_text.delta")
        # Stop reading: the buffers fill, a send stalls, the deadline fires.
        engine = server.engine
        await wait_until(lambda: engine.stats.cancelled == 1, timeout=60, what="drain deadline")
        await wait_until(lambda: engine.active_sequences == 0, what="slot freed")
    finally:
        await stream.aclose()
    async with server.client() as client:
        r = await client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi"})
    assert r.json()["output_text"] == "Hello world."


async def test_a_broken_channel_inside_a_turn_is_a_bug_not_a_hang_up(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the connection's own ClientGone ends the connection quietly: a
    BrokenResourceError from elsewhere in a turn (a bug) gets the error event
    and the connection goes on."""
    from mlxtrio.api.responses import socket

    real = socket._respond
    calls = 0

    async def broken_once(body: Any, connection: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise trio.BrokenResourceError("an internal channel")
        await real(body, connection)

    monkeypatch.setattr(socket, "_respond", broken_once)

    def script(connection: Any) -> tuple[Events, Events]:
        connection.response.create(model=SCRIPTED, input="Hi!")
        failed = [next(iter(connection)).to_dict()]
        return failed, _turn(connection, model=SCRIPTED, input="Hi!")

    failed, second = await _session(scripted, script, api_key="unused")
    assert failed[0]["type"] == "error" and failed[0]["status"] == 500
    assert _final(second)["output_text"] == "Hello world."
