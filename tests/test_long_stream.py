"""Long streams: one that outlives Quart's default response timeout (60 s)
still ends with its terminal event (Codex fails with "stream closed before
response.completed"), and a client that stops reading is dropped after the drain
deadline instead of holding a slot forever."""

from __future__ import annotations

import pytest
import quart
import trio

from .conftest import SCRIPTED, RawConnection, parse_sse, wait_until

LOOP = {"model": SCRIPTED, "input": "LOOP", "stream": True, "max_output_tokens": 10**9}


async def drain(conn: RawConnection) -> None:
    while await conn.stream.receive_some(65536):
        pass


QUART_TIMEOUT = 3  # Quart's default response timeout in this test (really 60 s)


async def test_stream_longer_than_quarts_response_timeout_gets_its_terminal_event(
    server_factory, scripted_model_path, monkeypatch
) -> None:
    # Quart's default, shortened so that the test runs in seconds: a server
    # that left Quart's timeout on would cut both streams after 3 s.
    defaults = quart.Quart.default_config
    shortened = type(defaults)({**defaults, "RESPONSE_TIMEOUT": QUART_TIMEOUT})
    monkeypatch.setattr(quart.Quart, "default_config", shortened)
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, sse_keepalive=0.5
    )
    holder = await RawConnection.open(server)
    await holder.post_json("/v1/responses", LOOP)
    await holder.read_until(b"response.output_text.delta")
    waiter = await RawConnection.open(server)
    await waiter.post_json("/v1/responses", {"model": SCRIPTED, "input": "hi", "stream": True})
    await waiter.read_until(b"response.created")
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain, holder)  # a well-behaved client: keeps reading
        await trio.sleep(3 * QUART_TIMEOUT)  # meanwhile the waiter's stream stays open
        nursery.cancel_scope.cancel()
    await holder.close()
    raw = await waiter.read_until(b"event: response.completed", timeout=30)
    assert trio.current_time() - started > 3 * QUART_TIMEOUT
    assert raw.count(b": keepalive") >= 10
    events = parse_sse(raw.split(b"\r\n\r\n", 1)[1].decode())
    assert events[-1][0] == "response.completed"
    await waiter.close()


@pytest.mark.slow
async def test_client_that_stops_reading_is_dropped_after_drain_deadline(
    server_factory, scripted_model_path
) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, sse_drain_timeout=2
    )
    stalled = await RawConnection.open(server)
    await stalled.post_json("/v1/responses", LOOP)
    await stalled.read_until(b"response.output_text.delta")
    # Stop reading. Socket buffers fill, the write stalls, the deadline fires.
    await wait_until(lambda: server.engine.stats.cancelled == 1, timeout=120, what="drain deadline")
    await wait_until(lambda: server.engine.active_sequences == 0, what="slot freed")
    async with server.client() as client:
        r = await client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi"})
    assert r.json()["output_text"] == "Hello world."
    await stalled.close()
