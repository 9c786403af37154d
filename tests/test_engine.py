"""The engine on its own, driven from Trio: batching, cancellation, seeds, lifecycle."""

from __future__ import annotations

import threading

import pytest
import trio

from mlxtrio.engine.config import EngineConfig
from mlxtrio.engine.engine import Engine, EngineState
from mlxtrio.engine.handle import EngineError
from mlxtrio.engine.types import SamplingParams
from mlxtrio.settings import EMBEDDED_MODEL_PATH


async def started_engine(path: str = str(EMBEDDED_MODEL_PATH), **kwargs) -> Engine:
    engine = Engine(
        "t",
        path,
        EngineConfig(capacity=kwargs.get("capacity", 4), prefill_chunk=64, default_max_tokens=32),
    )
    await engine.start()
    return engine


def prompt_for(engine: Engine, text: str = "hello") -> list[int]:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


async def collect(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str]:
    tokens: list[int] = []
    async with engine.submit(prompt, params) as handle:
        async for event in handle:
            tokens.extend(event.token_ids)
    return tokens, handle.finish_reason or ""


async def test_generation_respects_max_tokens_and_reports_stats() -> None:
    engine = await started_engine()
    try:
        tokens, reason = await collect(engine, prompt_for(engine), SamplingParams(max_tokens=7))
        assert reason in ("length", "stop")
        assert len(tokens) <= 7
        assert engine.stats.generated_tokens == len(tokens)
    finally:
        await engine.stop(1)


async def test_seeded_sampling_is_reproducible_inside_a_batch() -> None:
    engine = await started_engine()
    try:
        prompt = prompt_for(engine)
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=42)
        alone, _ = await collect(engine, prompt, params)
        results: list[list[int]] = []

        async def run(p: SamplingParams) -> None:
            results.append((await collect(engine, prompt, p))[0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, params)
            nursery.start_soon(run, SamplingParams(temperature=1.0, max_tokens=12, seed=7))
        assert alone in results
    finally:
        await engine.stop(1)


async def test_greedy_is_deterministic_alone_and_batched() -> None:
    engine = await started_engine()
    try:
        prompt = prompt_for(engine, "deterministic?")
        alone, _ = await collect(engine, prompt, SamplingParams(max_tokens=16))
        outs: list[list[int]] = []

        async def run(text: str) -> None:
            p = prompt if text == "same" else prompt_for(engine, text)
            outs.append((await collect(engine, p, SamplingParams(max_tokens=16)))[0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "same")
            nursery.start_soon(run, "a different and longer prompt for the batch")
        assert alone in outs
    finally:
        await engine.stop(1)


async def test_cancel_before_insertion_delivers_cancelled(scripted_model_path: str) -> None:
    engine = await started_engine(scripted_model_path)
    try:
        handle = engine.submit(prompt_for(engine, "LOOP"), SamplingParams(max_tokens=1000))
        handle.cancel()
        events = [event async for event in handle]
        assert events[-1].finish_reason == "cancelled"
        assert engine.active_sequences == 0
    finally:
        await engine.stop(1)


async def test_stop_cancels_in_flight_work_and_joins_the_thread(scripted_model_path: str) -> None:
    engine = await started_engine(scripted_model_path)
    handle = engine.submit(prompt_for(engine, "LOOP"), SamplingParams(max_tokens=100_000))
    await engine.stop(0.2)
    assert engine.state is EngineState.STOPPED
    assert not any(t.name == "mlxtrio-engine-t" for t in threading.enumerate())
    events = [event async for event in handle]
    assert events[-1].finish_reason == "cancelled"
    with pytest.raises(EngineError):
        engine.submit([1, 2, 3], SamplingParams())


async def test_load_failure_is_reported(tmp_path) -> None:
    engine = Engine(
        "broken", str(tmp_path), EngineConfig(capacity=1, prefill_chunk=8, default_max_tokens=8)
    )
    with pytest.raises(EngineError, match="failed to load"):
        await engine.start()
    assert engine.state is EngineState.FAILED
    await engine.stop(0.1)


async def test_health_and_routes_are_503_when_the_model_failed_to_load(
    server_factory, tmp_path
) -> None:
    server = await server_factory(model=str(tmp_path))
    async with server.client() as client:
        health = await client.get("/health")
        r = await client.post("/v1/responses", json={"model": tmp_path.name, "input": "hi"})
        root = await client.get("/")
    assert health.status_code == 503
    model = health.json()["models"][0]
    assert model["state"] == "failed" and "config.json" in model["error"]
    assert r.status_code == 503
    assert "not serving" in r.json()["error"]["message"]
    assert root.status_code == 200
