"""Memory that cannot crash the machine: admission weighs the KV a request can
reach (prompt + output cap) against ``memory_limit_bytes``, beside the loaded
weights; the prefix cache gives up its room first; what cannot fit now waits
and then gets a 503; what could never fit is refused at once."""

from __future__ import annotations

import httpx
import pytest
import trio

from mlxtrio.serving import memory

from .conftest import SCRIPTED, RawConnection, Server, ServerFactory, wait_until

KIB = 1024


async def guarded(server_factory: ServerFactory, scripted_model_path: str, room: int) -> Server:
    """The scripted model with ``room`` bytes of the budget left beside its weights."""
    probe = await server_factory(model=scripted_model_path, model_name=SCRIPTED)
    assert probe.engine.loaded is not None
    weights = probe.engine.loaded.weights_bytes
    return await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, memory_limit_bytes=weights + room
    )


def per_token(server: Server) -> int:
    assert server.engine.loaded is not None
    return server.engine.loaded.kv_bytes_per_token


async def prompt_tokens(client: httpx.AsyncClient, content: str) -> int:
    r = await client.post(
        "/v1/messages/count_tokens",
        json={"model": SCRIPTED, "messages": [{"role": "user", "content": content}]},
    )
    return int(r.json()["input_tokens"])


async def test_a_request_that_could_never_fit_is_refused_at_once(
    server_factory: ServerFactory, scripted_model_path: str
) -> None:
    server = await guarded(server_factory, scripted_model_path, room=256 * KIB)
    too_many = 2 * 256 * KIB // per_token(server)
    async with server.client() as client:
        messages = await client.post(
            "/v1/messages",
            json={
                "model": SCRIPTED,
                "max_tokens": too_many,
                "stream": True,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        responses = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": "Hi", "max_output_tokens": too_many},
        )
        fits = await client.post(
            "/v1/responses", json={"model": SCRIPTED, "input": "Hi", "max_output_tokens": 16}
        )
        health = (await client.get("/health")).json()
    assert messages.status_code == 400, messages.text
    assert messages.json()["error"]["type"] == "invalid_request_error"
    assert "memory" in messages.json()["error"]["message"]
    assert responses.status_code == 400
    error = responses.json()["error"]
    assert "memory_limit_bytes" in error["message"] and error["param"] == "input"
    assert fits.status_code == 200 and fits.json()["output_text"] == "Hello world."
    assert server.engine.stats.submitted == 1  # the refused ones never reached the engine
    assert health["memory"]["limit_bytes"] == server.services.memory.limit
    assert health["memory"]["reserved_kv_bytes"] == 0
    assert health["blas"]


async def test_a_request_that_does_not_fit_now_waits_then_gets_a_503(
    server_factory: ServerFactory, scripted_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "MEMORY_WAIT", 0.5)
    room = 5 * 1024 * KIB
    server = await guarded(server_factory, scripted_model_path, room=room)
    # Two of these do not fit together; one decodes for a few seconds.
    half = room // per_token(server) * 3 // 5
    hog = await RawConnection.open(server)
    await hog.post_json(
        "/v1/responses",
        {"model": SCRIPTED, "input": "LOOP", "max_output_tokens": half, "stream": True},
    )
    await hog.read_until(b"response.output_text.delta")
    body = {"model": SCRIPTED, "input": "Hi", "max_output_tokens": half}
    async with server.client() as client:
        with trio.fail_after(10):
            refused = await client.post("/v1/responses", json=body)
        anthropic = await client.post(
            "/v1/messages",
            json={
                "model": SCRIPTED,
                "max_tokens": half,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "5"
        assert "memory" in refused.json()["error"]["message"]
        assert anthropic.status_code == 503
        assert anthropic.json()["error"]["type"] == "overloaded_error"
        await hog.close()
        await wait_until(lambda: server.services.memory.reserved == 0, what="released")
        served = await client.post("/v1/responses", json=body)
    assert served.status_code == 200 and served.json()["output_text"] == "Hello world."


async def test_the_prefix_cache_gives_up_its_room_first(
    server_factory: ServerFactory, scripted_model_path: str
) -> None:
    server = await guarded(server_factory, scripted_model_path, room=512 * KIB)
    index = server.engine.cache.index
    async with server.client() as client:
        first = await client.post(
            "/v1/responses", json={"model": SCRIPTED, "input": "Hi", "max_output_tokens": 16}
        )
        assert first.status_code == 200
        await wait_until(lambda: index.nbytes > 0, what="a snapshot cached")
        cached = index.nbytes
        # A request that needs all the room but half of what the snapshot holds
        # (in another cache domain: it does not pin the snapshot to reuse it).
        prompt = await prompt_tokens(client, "Hi")
        room = server.services.memory.free
        wanted = (room - cached // 2) // per_token(server) - prompt
        second = await client.post(
            "/v1/responses",
            json={
                "model": SCRIPTED,
                "input": "Hi",
                "max_output_tokens": wanted,
                "cache_salt": "elsewhere",
            },
        )
    assert second.status_code == 200, second.text
    assert index.stats.evictions >= 1  # the first turn's snapshot made room
