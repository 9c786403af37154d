"""Long streams: one that outlives Quart's default 60 s response timeout still
ends with its terminal event (Codex fails with "stream closed before
response.completed"), and a client that stops reading is dropped after the drain
deadline instead of holding a slot forever."""

from __future__ import annotations

import pytest
import trio

from .conftest import SCRIPTED, RawConnection, parse_sse, wait_until

LOOP = {"model": SCRIPTED, "input": "LOOP", "stream": True, "max_output_tokens": 10**9}


async def drain(conn: RawConnection) -> None:
    while await conn.stream.receive_some(65536):
        pass


@pytest.mark.slow
async def test_stream_longer_than_60s_gets_its_terminal_event(
    server_factory, scripted_model_path
) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, sse_keepalive=5
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
        await trio.sleep(62)  # meanwhile the waiter's stream stays open on keepalives
        nursery.cancel_scope.cancel()
    await holder.close()
    raw = await waiter.read_until(b"event: response.completed", timeout=30)
    assert trio.current_time() - started > 60
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
