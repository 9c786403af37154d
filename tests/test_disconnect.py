"""Hang-ups at every stage stop generation: decode, prefill, queue - on each
API (``/v1/responses``, ``/v1/messages``, ``/v1/chat/completions``)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import trio

from .conftest import SCRIPTED, RawConnection, Server, wait_until

LOOP = {"model": SCRIPTED, "input": "LOOP forever", "max_output_tokens": 1_000_000}

APIS = ["responses", "messages", "chat_completions"]
# What a stream carries once the model decodes: a text delta of each API's
# events (`` la`` is the loop's piece; the first one may be stripped).
DECODING = {
    "responses": b"response.output_text.delta",
    "messages": b'"type":"text_delta"',
    "chat_completions": b'"content":" la"',
}


def request(api: str, text: str, cap: int | None = None, **fields: Any) -> tuple[str, dict]:
    """(path, body) of a one-message turn saying ``text`` on ``api``, its
    output capped at ``cap`` tokens (the API's own field) when given."""
    if api == "responses":
        body: dict[str, Any] = {"model": SCRIPTED, "input": text}
        if cap is not None:
            body["max_output_tokens"] = cap
        return "/v1/responses", {**body, **fields}
    messages = [{"role": "user", "content": text}]
    if api == "messages":
        body = {"model": SCRIPTED, "max_tokens": cap or 64, "messages": messages}
        return "/v1/messages", {**body, **fields}
    body = {"model": SCRIPTED, "messages": messages}
    if cap is not None:
        body["max_tokens"] = cap
    return "/v1/chat/completions", {**body, **fields}


def loop(api: str, **fields: Any) -> tuple[str, dict]:
    """A turn that decodes forever (the scripted model's ``LOOP``)."""
    if api == "responses":
        return "/v1/responses", {**LOOP, **fields}
    return request(api, "LOOP forever", 1_000_000, **fields)


async def assert_engine_idle_and_serving(server: Server) -> None:
    await wait_until(lambda: server.engine.active_sequences == 0, what="engine idle")
    async with server.client() as client:
        metrics = (await client.get("/metrics")).text
        r = await client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi"})
    assert 'mlxtrio_active_sequences{model="scripted"} 0.0' in metrics
    assert r.status_code == 200 and r.json()["output_text"] == "Hello world."


@pytest.mark.parametrize("api", APIS)
async def test_streaming_hangup_mid_decode(scripted: Server, api: str) -> None:
    conn = await RawConnection.open(scripted)
    await conn.post_json(*loop(api, stream=True))
    await conn.read_until(DECODING[api])
    await wait_until(lambda: scripted.engine.stats.generated_tokens > 20, what="decoding")
    await conn.close()
    await wait_until(lambda: scripted.engine.stats.cancelled == 1, what="cancelled")
    assert scripted.engine.stats.cancel_latency_steps[-1] <= 2
    await assert_engine_idle_and_serving(scripted)


@pytest.mark.parametrize("api", APIS)
async def test_non_streaming_hangup_mid_decode(scripted: Server, api: str) -> None:
    conn = await RawConnection.open(scripted)
    await conn.post_json(*loop(api))
    await wait_until(lambda: scripted.engine.stats.generated_tokens > 20, what="decoding")
    await conn.close()
    await wait_until(lambda: scripted.engine.stats.cancelled == 1, what="cancelled")
    assert scripted.engine.stats.cancel_latency_steps[-1] <= 2
    stats = scripted.engine.stats.last_cancelled
    assert stats is not None and stats.generated_tokens < 1_000_000
    await assert_engine_idle_and_serving(scripted)


@pytest.mark.parametrize("api", APIS)
async def test_hangup_during_prefill_stops_at_next_chunk(
    server_factory, scripted_model_path, api: str
) -> None:
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, prefill_chunk=8)
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    long_prompt = " ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(6000))
    conn = await RawConnection.open(server)
    await conn.post_json(*request(api, long_prompt, stream=True))
    await wait_until(lambda: server.engine.stats.steps > 5, what="prefill started")
    await conn.close()
    await wait_until(lambda: server.engine.stats.cancelled == 1, what="cancelled")
    stats = server.engine.stats.last_cancelled
    assert stats is not None
    assert stats.generated_tokens == 0, "hung up during prefill: nothing may be decoded"
    assert 0 < stats.prefilled_tokens < stats.prompt_tokens
    assert server.engine.stats.cancel_latency_steps[-1] <= 2
    await assert_engine_idle_and_serving(server)


@pytest.mark.parametrize("api", APIS)
async def test_hangup_while_queued_costs_no_engine_work(
    server_factory, scripted_model_path, api: str
) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, waiting_room=4
    )
    lane = server.services.lanes[SCRIPTED]
    running = await RawConnection.open(server)
    await running.post_json(*loop(api, stream=True))
    await running.read_until(DECODING[api])
    for stream in (False, True):
        queued = await RawConnection.open(server)
        await queued.post_json(*request(api, "hi", stream=stream))
        await wait_until(lambda: lane.waiting == 1, what="queued")
        await queued.close()
        await wait_until(lambda: lane.waiting == 0, what="left the queue")
    assert server.engine.stats.submitted == 1  # only the running request reached the engine
    await running.close()
    await assert_engine_idle_and_serving(server)


async def test_full_waiting_room_answers_429_at_once(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, waiting_room=1
    )
    lane = server.services.lanes[SCRIPTED]
    running = await RawConnection.open(server)
    await running.post_json("/v1/responses", {**LOOP, "stream": True})
    await running.read_until(b"response.output_text.delta")
    queued = await RawConnection.open(server)
    await queued.post_json("/v1/responses", {"model": SCRIPTED, "input": "hi"})
    await wait_until(lambda: lane.waiting == 1, what="queued")
    async with server.client() as client:
        with trio.fail_after(5):
            r = await client.post(
                "/v1/responses", json={"model": SCRIPTED, "input": "hi", "stream": True}
            )
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    assert "Retry after" in error["message"]
    # The queued request is served once the slot frees.
    await running.close()
    raw = await queued.read_until(b'"status":"completed"')
    assert raw.startswith(b"HTTP/1.1 200")
    await queued.close()


async def test_keepalive_while_queued(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, sse_keepalive=0.2
    )
    running = await RawConnection.open(server)
    await running.post_json("/v1/responses", {**LOOP, "stream": True})
    await running.read_until(b"response.output_text.delta")
    queued = await RawConnection.open(server)
    await queued.post_json("/v1/responses", {"model": SCRIPTED, "input": "hi", "stream": True})
    raw = await queued.read_until(b": keepalive\n\n", timeout=5)
    assert b"event: response.created" in raw  # announced before the slot was free
    await running.close()
    raw = await queued.read_until(b"event: response.completed")
    body = raw.split(b"\r\n\r\n", 1)[1].decode()
    data = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert data[-1]["response"]["output_text"] == "Hello world."
    await queued.close()
