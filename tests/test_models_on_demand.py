"""Models on demand: every model in models_dir is listed and loads on the first
request naming it; the least recently used idle model makes room, a busy or
pinned one never does; an idle model is unloaded after its keep-alive; a full
load queue is a 429; an invalid request loads nothing; an unloaded model gives
its memory back and reloads warm from its disk KV tier.

The models (real mlx-lm architectures, tiny random weights): the scripted
Qwen3 model, a Gemma 3 with a sliding window, a Qwen3.5 with recurrent
layers; the embedded model is the main one (loaded at start)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxtrio.engine.threads import pool_size
from mlxtrio.serving import residency

from .conftest import RawConnection, Server, ServerFactory, wait_until

MAIN = "mlxtrio-tiny"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory, scripted_model_path: str) -> str:
    from .scripted_hybrid import build_hybrid

    base = tmp_path_factory.mktemp("models")
    shutil.copytree(scripted_model_path, base / "qwen")
    build_hybrid(base / "gemma", "sliding")
    build_hybrid(base / "hybrid", "ssm")
    (base / "not-a-model").mkdir()
    return str(base)


@pytest.fixture
def no_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what the test puts in models_dir: an empty Hugging Face cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))


async def on_demand(factory: ServerFactory, models_dir: str, **settings: Any) -> Server:
    return await factory(models_dir=models_dir, **settings)


async def states(server: Server) -> dict[str, str]:
    async with server.client() as client:
        body = (await client.get("/v1/models")).json()
    return {m["id"]: m["state"] for m in body["data"] if "alias_of" not in m}


async def ask(server: Server, model: str, content: str = "Hi", **extra: Any) -> Any:
    async with server.client() as client:
        return await client.post(
            "/v1/responses",
            json={"model": model, "input": content, "max_output_tokens": 8, **extra},
        )


def loads(caplog: pytest.LogCaptureFixture, model: str) -> int:
    return sum(1 for r in caplog.records if r.getMessage().startswith(f"model {model} loaded in"))


async def test_every_model_is_listed_and_loads_on_first_use(
    server_factory: ServerFactory,
    models_dir: str,
    no_hf_cache: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", "mlxtrio.models")
    server = await on_demand(server_factory, models_dir)
    async with server.client() as client:
        listed = (await client.get("/v1/models")).json()["data"]
    by_name = {m["id"]: m for m in listed}
    assert set(by_name) >= {MAIN, "qwen", "gemma", "hybrid"} and "not-a-model" not in by_name
    assert by_name[MAIN]["state"] == "loaded"
    assert by_name["gemma"]["state"] == "available" and by_name["gemma"]["family"] == "gemma3_text"
    assert by_name["hybrid"]["family"] == "qwen3_5" and by_name["hybrid"]["size_bytes"] > 0
    assert by_name["gemma"]["context_window"] == 65536  # from its config, before loading
    # Three requests at once for an unloaded model: one load, three answers.
    answers: list[int] = []

    async def one() -> None:
        answers.append((await ask(server, "gemma")).status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert answers == [200, 200, 200]
    assert loads(caplog, "gemma") == 1
    assert (await states(server))["gemma"] == "loaded"
    async with server.client() as client:
        health = (await client.get("/health")).json()
    gemma = next(m for m in health["models"] if m["id"] == "gemma")
    assert gemma["state"] == "ready" and gemma["load_seconds"] > 0


async def test_a_switch_evicts_the_idle_model_and_never_a_busy_one(
    server_factory: ServerFactory,
    models_dir: str,
    no_hf_cache: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(residency, "LOAD_WAIT", 1.0)
    server = await on_demand(server_factory, models_dir, max_loaded_models=1)
    assert (await ask(server, "qwen")).status_code == 200  # the idle main model made room
    assert (await states(server))[MAIN] == "available"
    # qwen busy: a request for another model waits, then gets a 503; qwen stays.
    busy = await RawConnection.open(server)
    await busy.post_json(
        "/v1/responses",
        {"model": "qwen", "input": "LOOP", "max_output_tokens": 100_000, "stream": True},
    )
    await busy.read_until(b"response.output_text.delta")
    refused = await ask(server, "gemma")
    assert refused.status_code == 503, refused.text
    assert "memory" in refused.json()["error"]["message"]
    assert (await states(server))["qwen"] == "loaded"
    await busy.close()
    served = await ask(server, "gemma")  # qwen is idle now: it makes room
    assert served.status_code == 200
    now = await states(server)
    assert now["gemma"] == "loaded" and now["qwen"] == "available"


async def test_a_pinned_model_survives(
    server_factory: ServerFactory, models_dir: str, no_hf_cache: None
) -> None:
    server = await on_demand(server_factory, models_dir, max_loaded_models=2, pinned_models=(MAIN,))
    assert (await ask(server, "qwen")).status_code == 200
    assert (await ask(server, "gemma")).status_code == 200  # the main model is pinned
    now = await states(server)
    assert now[MAIN] == "loaded" and now["gemma"] == "loaded" and now["qwen"] == "available"


async def test_an_idle_model_is_unloaded_after_its_keep_alive(
    server_factory: ServerFactory, models_dir: str, no_hf_cache: None
) -> None:
    server = await on_demand(
        server_factory, models_dir, keep_alive_seconds=1.0, model_keep_alive={MAIN: "0"}
    )
    assert (await ask(server, "gemma")).status_code == 200
    assert (await states(server))["gemma"] == "loaded"
    with trio.fail_after(10):
        while (await states(server))["gemma"] != "available":
            await trio.sleep(0.2)
    assert (await states(server))[MAIN] == "loaded"  # its keep-alive is 0: never


async def test_a_full_load_queue_is_a_429_on_both_envelopes(
    server_factory: ServerFactory, models_dir: str, no_hf_cache: None
) -> None:
    server = await on_demand(server_factory, models_dir, waiting_room=1)
    models = server.services.models
    async with models._load_lock:  # a load in progress, for as long as this holds
        waiting = await RawConnection.open(server)
        await waiting.post_json(
            "/v1/responses", {"model": "gemma", "input": "Hi", "max_output_tokens": 8}
        )
        await wait_until(lambda: models.resolve("gemma").waiting == 1, what="waiting")
        leaving = await RawConnection.open(server)
        async with server.client() as client:
            openai = await client.post("/v1/responses", json={"model": "gemma", "input": "Hi"})
            anthropic = await client.post(
                "/v1/messages",
                json={
                    "model": "gemma",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
            )
        await leaving.close()
    assert openai.status_code == 429 and openai.headers["retry-after"] == "1"
    assert openai.json()["error"]["type"] == "rate_limit_error"
    assert "Model queue full" in openai.json()["error"]["message"]
    assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == "1"
    assert anthropic.json()["error"]["type"] == "rate_limit_error"
    raw = await waiting.read_until(b'"output_text"')
    assert raw.startswith(b"HTTP/1.1 200")
    await waiting.close()


async def test_an_invalid_request_loads_nothing(
    server_factory: ServerFactory, models_dir: str, no_hf_cache: None
) -> None:
    server = await on_demand(server_factory, models_dir)
    async with server.client() as client:
        missing = await client.post(
            "/v1/messages", json={"model": "gemma", "messages": [{"role": "user", "content": "x"}]}
        )
        orphan = await client.post(
            "/v1/chat/completions",
            json={
                "model": "gemma",
                "messages": [{"role": "tool", "tool_call_id": "a", "content": "x"}],
            },
        )
        unknown = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
        bad_image = await client.post(
            "/v1/responses",
            json={
                "model": "gemma",
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
                        ],
                    }
                ],
            },
        )
    assert missing.status_code == 400 and orphan.status_code == 400
    assert bad_image.status_code == 400 and "could not be decoded" in bad_image.text
    assert unknown.status_code == 404 and "gemma" in unknown.json()["error"]["message"]
    assert (await states(server))["gemma"] == "available"


async def test_unload_frees_memory_and_a_reload_starts_warm_from_disk(
    server_factory: ServerFactory, models_dir: str, no_hf_cache: None
) -> None:
    server = await on_demand(server_factory, models_dir)
    main = server.engine
    await wait_until(lambda: main.stats.mlx_active_bytes > 0, what="idle baseline")
    baseline = main.stats.mlx_active_bytes
    prompt = " ".join(f"note {i}" for i in range(400))  # several 256-token blocks
    first = await ask(server, "qwen", prompt)
    assert first.status_code == 200 and first.headers["x-cached-tokens"] == "0"
    resident = server.services.models.resolve("qwen")
    engine = resident.engine
    assert engine is not None and engine.cache.index.disk is not None
    disk = engine.cache.index.disk
    await wait_until(lambda: len(disk) >= 2, timeout=30, what="blocks on disk")
    async with server.client() as client:
        unloaded = await client.post("/v1/models/unload", json={"model": "qwen"})
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "available"
    # The unloaded engine gave MLX's memory back: what is held is the main
    # model's again (its weights and its cache).
    assert engine.loaded is None
    assert engine.stats.mlx_active_bytes <= baseline * 1.05 + (1 << 20)
    again = await ask(server, "qwen", prompt)
    assert again.status_code == 200
    assert int(again.headers["x-cached-tokens"]) >= 256  # read back from its disk tier
    assert again.json()["output_text"] == first.json()["output_text"]


async def test_load_and_unload_endpoints_and_aliases(
    server_factory: ServerFactory, models_dir: str, no_hf_cache: None
) -> None:
    server = await on_demand(server_factory, models_dir, aliases={"fast": "hybrid"})
    async with server.client() as client:
        loaded = await client.post("/v1/models/load", json={"model": "hybrid"})
        assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
        bad = await client.post("/v1/models/load", json={"name": "hybrid"})
        assert bad.status_code == 400
        unloaded = await client.post("/v1/models/unload", json={"model": "fast"})
        assert unloaded.status_code == 200 and unloaded.json()["state"] == "available"
    # The alias resolves to the model, and loads it.
    assert (await ask(server, "fast")).status_code == 200
    assert (await states(server))["hybrid"] == "loaded"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
async def test_switching_models_costs_no_thread(
    server_factory: ServerFactory, models_dir: str, no_hf_cache: None
) -> None:
    """MLX keeps a thread's streams (a native thread each, and buffers) after
    the thread ends: engines run on pooled threads, so switching back and forth
    leaves the process's threads as they were after the first switch."""

    def os_threads() -> int:
        return len(list(Path("/proc/self/task").iterdir()))

    server = await on_demand(server_factory, models_dir, max_loaded_models=1)
    async with server.client() as client:

        async def load(model: str) -> None:
            answer = await client.post("/v1/models/load", json={"model": model})
            assert answer.status_code == 200, answer.text
            assert (await ask(server, model)).status_code == 200

        await load("qwen")
        await load(MAIN)
        before, engine_threads = os_threads(), pool_size()
        for _ in range(3):
            await load("qwen")
            await load(MAIN)
    assert pool_size() == engine_threads
    # Trio's idle worker threads come and go: a little slack, not one per switch.
    assert os_threads() <= before + 2
