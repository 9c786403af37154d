"""One request's failure is that request's: the engine survives bad sampling
values, failing processors, failing steps and even its thread dying, and every
submitted handle gets exactly one terminal event.

Faults the wire can no longer cause (validation refuses them) are injected in
process, into the real engine on the real model."""

from __future__ import annotations

import httpx
import pytest
import trio
from mlx_lm.generate import GenerationBatch

from mlxtrio.engine import loop, supervisor
from mlxtrio.engine.config import EngineConfig
from mlxtrio.engine.engine import Engine, EngineState
from mlxtrio.engine.handle import EngineError, GenerationHandle
from mlxtrio.engine.processors import openings
from mlxtrio.engine.types import SamplingParams, TextConstraint

from .conftest import SCRIPTED, Server, parse_sse, wait_until
from .test_engine import prompt_for, started_engine


async def outcome(handle: GenerationHandle) -> tuple[int, str]:
    """(tokens, terminal) where terminal is the finish reason or "error"; also
    checks that nothing follows the terminal event."""
    tokens = 0
    try:
        async for event in handle:
            tokens += len(event.token_ids)
            if event.finish_reason is not None:
                break
    except EngineError:
        return tokens, "error"
    assert handle.done
    return tokens, handle.finish_reason or "?"


# -- values that used to kill the engine --------------------------------------


async def test_sampling_values_that_crashed_the_engine_are_served(scripted: Server) -> None:
    async with scripted.client() as client:
        r1 = await client.post(
            "/v1/messages",
            json={
                "model": SCRIPTED,
                "max_tokens": 8,
                "temperature": 1,
                "top_k": 100000,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        replies = [
            await client.post(
                "/v1/responses",
                json={"model": SCRIPTED, "input": "hi", "temperature": 1, "seed": seed},
            )
            for seed in (-1, -(2**63), 2**64 - 1, 0)
        ]
        health = await client.get("/health")
    assert r1.status_code == 200, r1.text
    assert r1.json()["content"][0]["text"] == "Hello world."
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["status"] == "completed"
    assert health.status_code == 200 and scripted.engine.state is EngineState.READY


async def test_any_64_bit_seed_maps_to_a_reproducible_key() -> None:
    engine = await started_engine()  # the embedded model: sampling varies by seed
    try:
        prompt = prompt_for(engine, "Tell me a story")
        runs = []
        for seed in (-1, 2**64 - 1, -1):
            params = SamplingParams(temperature=1.0, max_tokens=12, seed=seed)
            async with engine.submit(prompt, params) as handle:
                runs.append([t async for e in handle for t in e.token_ids])
        assert runs[0] and runs[0] == runs[2]  # the same seed reproduces
        assert runs[0] == runs[1]  # -1 and 2**64-1 name the same 64-bit key
    finally:
        await engine.stop(1)


# -- failures inside the engine --------------------------------------------------


async def test_a_failing_logits_processor_ends_only_its_sequence(
    scripted_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self, context, logits):  # type: ignore[no-untyped-def]
        raise RuntimeError("processor bug")

    monkeypatch.setattr(openings.OpeningConstraint, "__call__", broken)
    engine = await started_engine(scripted_model_path)
    try:
        prompt = prompt_for(engine, "LOOP")
        healthy = engine.submit(prompt, SamplingParams(max_tokens=40))
        doomed = engine.submit(
            prompt, SamplingParams(max_tokens=40, constraints=(TextConstraint(("la",)),))
        )
        results: dict[str, tuple[int, str]] = {}

        async def run(name: str, handle: GenerationHandle) -> None:
            results[name] = await outcome(handle)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "healthy", healthy)
            nursery.start_soon(run, "doomed", doomed)
        assert results["doomed"][1] == "error"
        assert results["healthy"] == (40, "length")
        assert engine.state is EngineState.READY and engine.restarts == 0
    finally:
        await engine.stop(1)


async def test_a_failing_step_fails_its_batch_and_the_engine_goes_on(
    scripted_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(
        "t", scripted_model_path, EngineConfig(capacity=1, prefill_chunk=64, default_max_tokens=32)
    )
    await engine.start()
    try:
        prompt = prompt_for(engine, "LOOP")
        running = engine.submit(prompt, SamplingParams(max_tokens=100_000))
        first = await running.__anext__()
        assert first.token_ids
        # capacity 1: this one waits in the generator's queue, outside the step
        queued = engine.submit(prompt_for(engine, "hi"), SamplingParams(max_tokens=8))
        await wait_until(lambda: engine.stats.submitted == 2, what="queued inserted")
        real_step = GenerationBatch._step
        calls = {"n": 0}

        def failing_once(self):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("step bug")
            return real_step(self)

        monkeypatch.setattr(GenerationBatch, "_step", failing_once)
        assert (await outcome(running))[1] == "error"
        tokens, reason = await outcome(queued)
        assert reason == "stop" and tokens > 0
        assert engine.state is EngineState.READY and engine.restarts == 0
    finally:
        await engine.stop(1)


async def test_a_dead_engine_thread_restarts_and_every_handle_terminates(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = scripted.engine
    real_collect = loop.EngineLoop._collect
    died = {"n": 0}

    def dying_once(self, *args):  # type: ignore[no-untyped-def]
        if died["n"] == 0:
            died["n"] += 1
            raise RuntimeError("engine bug")
        return real_collect(self, *args)

    # A submit that races the death: it lands after the thread died, before the
    # Trio side learns of it - no thread will ever read its command.
    real_exit = Engine._on_thread_exit
    racing: list[GenerationHandle] = []

    def exit_with_a_racing_submit(self, error):  # type: ignore[no-untyped-def]
        assert self.state is EngineState.READY
        racing.append(self.submit(prompt, SamplingParams(max_tokens=5)))
        real_exit(self, error)

    monkeypatch.setattr(loop.EngineLoop, "_collect", dying_once)
    monkeypatch.setattr(Engine, "_on_thread_exit", exit_with_a_racing_submit)
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF", 1.0)  # /health can see it
    prompt = prompt_for(engine, "LOOP")
    handles = [engine.submit(prompt, SamplingParams(max_tokens=50)) for _ in range(5)]
    outcomes = [await outcome(h) for h in handles]
    assert len(racing) == 1  # the thread has died and the Trio side has heard of it
    outcomes.append(await outcome(racing[0]))
    assert all(reason == "error" for _, reason in outcomes)
    async with scripted.client() as client:
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["models"][0]["state"] == "restarting"
        refused = await client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi"})
        assert refused.status_code == 503 and "restarting" in refused.text
        with trio.fail_after(30):
            while (await client.get("/health")).status_code != 200:
                await trio.sleep(0.05)
        r = await client.post("/v1/responses", json={"model": SCRIPTED, "input": "hi"})
    assert r.status_code == 200 and r.json()["output_text"] == "Hello world."
    assert engine.restarts == 1 and engine.active_sequences == 0


async def test_a_crash_loop_gives_up_with_a_clear_error(
    scripted_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def always_dying(self, *args):  # type: ignore[no-untyped-def]
        raise RuntimeError("engine bug")

    monkeypatch.setattr(loop.EngineLoop, "_collect", always_dying)
    engine = await started_engine(scripted_model_path)
    try:
        prompt = prompt_for(engine, "hi")
        with trio.fail_after(60):
            while engine.state is not EngineState.FAILED:
                try:
                    handle = engine.submit(prompt, SamplingParams(max_tokens=4))
                except EngineError:  # restarting
                    await trio.sleep(0.01)
                    continue
                assert (await outcome(handle))[1] == "error"
        assert "died 4 times" in (engine.error or "")
        with pytest.raises(EngineError):
            engine.submit(prompt, SamplingParams(max_tokens=4))
    finally:
        await engine.stop(0.5)


async def test_submits_racing_shutdown_all_terminate(scripted_model_path: str) -> None:
    engine = await started_engine(scripted_model_path)
    prompt = prompt_for(engine, "LOOP")
    handles = [engine.submit(prompt, SamplingParams(max_tokens=10_000)) for _ in range(6)]
    await engine.stop(0)
    outcomes = [await outcome(h) for h in handles]
    assert {reason for _, reason in outcomes} <= {"cancelled", "length"}
    assert engine.active_sequences == 0


# -- a bug in the response path still ends the stream properly ------------------------


async def stream_both(server: Server) -> tuple[httpx.Response, httpx.Response]:
    """One streamed turn on each API."""
    async with server.client() as client:
        responses = await client.post(
            "/v1/responses", json={"model": SCRIPTED, "input": "hi", "stream": True}
        )
        messages = await client.post(
            "/v1/messages",
            json={
                "model": SCRIPTED,
                "max_tokens": 8,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    return responses, messages


async def test_a_producer_bug_ends_the_stream_with_its_terminal_event(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxtrio.api.messages.events import MessageAssembler
    from mlxtrio.api.responses.events import ResponseAssembler

    async def broken(self, *args):  # type: ignore[no-untyped-def]
        raise RuntimeError("assembler bug")

    monkeypatch.setattr(ResponseAssembler, "complete", broken)
    monkeypatch.setattr(MessageAssembler, "finish", broken)
    responses, messages = await stream_both(scripted)
    events = [e for e, _ in parse_sse(responses.text)]
    assert events[-1] == "response.failed", events
    assert "internal server error" in responses.text and "assembler bug" not in responses.text
    events = [e for e, _ in parse_sse(messages.text)]
    assert events[-1] == "error" and "message_stop" not in events, events
    assert scripted.engine.state is EngineState.READY


async def test_a_stream_whose_failure_path_fails_too_still_ends(
    scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxtrio.api.messages.events import MessageAssembler
    from mlxtrio.api.responses.events import ResponseAssembler

    async def broken(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("assembler bug")

    for cls, method in ((ResponseAssembler, "complete"), (MessageAssembler, "finish")):
        monkeypatch.setattr(cls, method, broken)
        monkeypatch.setattr(cls, "mark_failed" if cls is ResponseAssembler else "fail", broken)
    responses, messages = await stream_both(scripted)
    events = parse_sse(responses.text)
    name, last = events[-1]
    assert name == "error" and last["code"] == "server_error", events[-2:]
    assert last["sequence_number"] == events[-2][1]["sequence_number"] + 1
    name, last = parse_sse(messages.text)[-1]
    assert name == "error" and last["error"]["type"] == "api_error"
