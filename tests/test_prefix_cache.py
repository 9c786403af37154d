"""Prefix KV cache: multi-turn reuse on every API, interleaving, eviction,
isolation, exact reporting, and cached == cold greedy output."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.lowlevel

from mlxtrio.engine.config import EngineConfig
from mlxtrio.engine.engine import Engine
from mlxtrio.engine.types import SamplingParams
from mlxtrio.settings import EMBEDDED_MODEL_PATH

from .conftest import SCRIPTED, Server, parse_sse, wait_until

SLACK = 2  # tokens the template may re-render differently at a turn boundary


SYSTEM = "You are a coding agent. " * 40


async def test_messages_stateless_resend_stays_warm(scripted: Server) -> None:
    messages: list[dict] = []
    previous_total = None
    async with scripted.anthropic() as client:
        for turn in range(5):
            messages.append({"role": "user", "content": f"Question number {turn}?"})
            reply = await client.messages.create(
                model=SCRIPTED, max_tokens=32, system=SYSTEM, messages=messages
            )
            usage = reply.usage
            prompt = usage.input_tokens + usage.cache_read_input_tokens
            if previous_total is not None:
                assert usage.cache_read_input_tokens >= previous_total - SLACK, (turn, usage)
            else:
                assert usage.cache_read_input_tokens == 0
            previous_total = prompt + usage.output_tokens
            messages.append({"role": "assistant", "content": reply.content[0].text})


@dataclass
class Resent:
    """One stateless turn as its API reports it."""

    text: str
    prompt: int  # every prompt token, cached or not
    cached: int  # the usage's cached prompt tokens
    output: int
    header: int  # X-Cached-Tokens
    state: str  # X-Session-Cache


async def _resend(server: Server, api: str, history: list[dict]) -> Resent:
    """The whole ``history`` sent again (after the same system prompt) through
    ``api``'s official SDK."""
    if api == "messages":
        async with server.anthropic() as anthropic_client:
            raw = await anthropic_client.messages.with_raw_response.create(
                model=SCRIPTED, max_tokens=32, system=SYSTEM, messages=history
            )
        reply = await raw.parse()  # the anthropic SDK's raw response parses async
        read = reply.usage.cache_read_input_tokens or 0
        prompt, output = reply.usage.input_tokens + read, reply.usage.output_tokens
        text = reply.content[0].text  # type: ignore[union-attr]
    elif api == "responses":
        async with server.openai() as client:
            raw = await client.responses.with_raw_response.create(
                model=SCRIPTED, instructions=SYSTEM, input=history
            )
        response = raw.parse()
        assert response.usage is not None
        usage = response.usage
        read, prompt = usage.input_tokens_details.cached_tokens, usage.input_tokens
        output, text = usage.output_tokens, response.output_text
    else:
        async with server.openai() as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=SCRIPTED, messages=[{"role": "system", "content": SYSTEM}, *history]
            )
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.prompt_tokens_details
        read = completion.usage.prompt_tokens_details.cached_tokens or 0
        prompt, output = completion.usage.prompt_tokens, completion.usage.completion_tokens
        text = completion.choices[0].message.content or ""
    headers = raw.headers
    return Resent(
        text, prompt, read, output, int(headers["x-cached-tokens"]), headers["x-session-cache"]
    )


@pytest.mark.parametrize("api", ["messages", "responses", "chat_completions"])
async def test_stateless_resend_stays_warm_on_every_api(scripted: Server, api: str) -> None:
    """The client resends the whole conversation each turn: every turn starts
    from the previous one's KV, and ``X-Cached-Tokens`` (equal to the usage's
    cached count) grows with the conversation."""
    history: list[dict] = []
    turns: list[Resent] = []
    for turn in range(5):
        history.append({"role": "user", "content": f"Question number {turn}?"})
        sent = await _resend(scripted, api, history)
        assert sent.header == sent.cached, (api, turn, sent)
        assert sent.text == "Hello world.", (api, turn, sent)
        turns.append(sent)
        history.append({"role": "assistant", "content": sent.text})
    assert (turns[0].header, turns[0].state) == (0, "fresh"), turns
    for previous, sent in zip(turns, turns[1:], strict=False):
        assert sent.header >= previous.prompt + previous.output - SLACK, (api, turns)
        assert sent.header > previous.header, (api, turns)
        assert sent.state == "prefix_hit", (api, turns)


async def _responses_turns(server: Server, mode: str) -> list[tuple[int, int, int, str]]:
    """Five turns; returns (input, cached, output, X-Session-Cache) per turn."""
    rows = []
    history: list[dict] = []
    previous_id = None
    async with server.openai() as client:
        for turn in range(5):
            user = {"role": "user", "content": f"Question number {turn}?"}
            kwargs: dict = {"model": SCRIPTED, "instructions": SYSTEM}
            if mode == "previous_response_id":
                kwargs.update(input=[user], previous_response_id=previous_id)
                if previous_id is None:
                    del kwargs["previous_response_id"]
            else:
                history.append(user)
                kwargs["input"] = list(history)
                if mode == "prompt_cache_key":
                    kwargs["prompt_cache_key"] = "session-1"
            raw = await client.responses.with_raw_response.create(**kwargs)
            response = raw.parse()
            usage = response.usage
            rows.append(
                (
                    usage.input_tokens,
                    usage.input_tokens_details.cached_tokens,
                    usage.output_tokens,
                    raw.headers["x-session-cache"],
                )
            )
            assert int(raw.headers["x-cached-tokens"]) == usage.input_tokens_details.cached_tokens
            previous_id = response.id
            history.append({"role": "assistant", "content": response.output_text})
    return rows


async def test_responses_reuse_paths_stay_warm(scripted: Server) -> None:
    for mode in ("stateless", "prompt_cache_key", "previous_response_id"):
        rows = await _responses_turns(scripted, mode)
        for (prev_in, _, prev_out, _), (_, cached, _, state) in zip(rows, rows[1:], strict=False):
            assert cached >= prev_in + prev_out - SLACK, (mode, rows)
            assert state == ("hit" if mode == "previous_response_id" else "prefix_hit")
        if mode == "stateless":  # the very first request of the server ran cold
            assert rows[0][1] == 0 and rows[0][3] == "fresh"


async def test_two_interleaved_conversations_both_stay_warm(scripted: Server) -> None:
    histories: dict[str, list[dict]] = {"a": [], "b": []}
    totals: dict[str, int] = {}
    async with scripted.anthropic() as client:
        for turn in range(3):
            for name in ("a", "b"):
                history = histories[name]
                history.append({"role": "user", "content": f"{name} asks question {turn}"})
                reply = await client.messages.create(
                    model=SCRIPTED,
                    max_tokens=16,
                    system=f"Conversation {name}. " * 30,
                    messages=history,
                )
                usage = reply.usage
                if name in totals:
                    assert usage.cache_read_input_tokens >= totals[name] - SLACK, (
                        name,
                        turn,
                        usage,
                    )
                totals[name] = (
                    usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens
                )
                history.append({"role": "assistant", "content": reply.content[0].text})


async def test_eviction_under_a_tiny_byte_budget(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path,
        model_name=SCRIPTED,
        prefix_cache_bytes=200_000,
        prefix_cache_disk_bytes=0,  # no disk tier to find it again
    )
    async with server.anthropic() as client:
        for i in range(4):
            await client.messages.create(
                model=SCRIPTED,
                max_tokens=8,
                system=f"Topic {i}. " * 60,
                messages=[{"role": "user", "content": "hi"}],
            )
        first_again = await client.messages.create(
            model=SCRIPTED,
            max_tokens=8,
            system="Topic 0. " * 60,
            messages=[{"role": "user", "content": "hi"}],
        )
    index = server.engine.cache.index
    assert index.stats.evictions > 0
    assert index.nbytes <= 200_000
    assert first_again.usage.cache_read_input_tokens < 100  # its snapshot was evicted
    async with server.client() as http:
        metrics = (await http.get("/metrics")).text
    assert 'mlxtrio_prefix_cache_evictions_total{model="scripted"}' in metrics
    assert "mlxtrio_prefix_cache_bytes" in metrics


async def test_cache_salt_domains_never_share(scripted: Server) -> None:
    body = {"model": SCRIPTED, "instructions": SYSTEM, "input": "hello"}
    async with scripted.client() as client:
        first = await client.post("/v1/responses", json={**body, "cache_salt": "tenant-a"})
        same_salt = await client.post("/v1/responses", json={**body, "cache_salt": "tenant-a"})
        other_salt = await client.post("/v1/responses", json={**body, "cache_salt": "tenant-b"})
        no_salt = await client.post("/v1/responses", json=body)
    assert first.headers["x-session-cache"] == "fresh"
    assert int(same_salt.headers["x-cached-tokens"]) > 0
    assert other_salt.headers["x-cached-tokens"] == "0"
    assert no_salt.headers["x-cached-tokens"] == "0"


async def test_each_api_key_is_its_own_domain(server_factory, scripted_model_path) -> None:
    """With several keys configured, a key's requests never reuse another key's
    prefixes, on either API (and a salt narrows a key's domain further)."""
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, api_key="key-a, key-b,key-c"
    )
    body = {"model": SCRIPTED, "instructions": SYSTEM, "input": "hello"}
    message = {
        "model": SCRIPTED,
        "system": SYSTEM,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello"}],
    }

    async def cached(path: str, key: str, payload: dict) -> int:
        async with server.client() as client:
            r = await client.post(path, json=payload, headers={"x-api-key": key})
        assert r.status_code == 200, r.text
        return int(r.headers["x-cached-tokens"])

    assert await cached("/v1/responses", "key-a", body) == 0
    assert await cached("/v1/responses", "key-a", body) > 0
    assert await cached("/v1/responses", "key-b", body) == 0
    assert await cached("/v1/responses", "key-a", {**body, "cache_salt": "s"}) == 0
    # The same system prompt is cached under key-a and key-b by now: key-c sees none.
    assert await cached("/v1/messages", "key-c", message) == 0
    assert await cached("/v1/messages", "key-c", message) > 0


async def test_streaming_headers_are_exact(scripted: Server) -> None:
    body = {"model": SCRIPTED, "instructions": SYSTEM, "input": "hello", "stream": True}
    async with scripted.client() as client:
        await client.post("/v1/responses", json=body)
        r = await client.post("/v1/responses", json=body)
        anthropic_body = {
            "model": SCRIPTED,
            "max_tokens": 8,
            "system": SYSTEM,
            "stream": True,
            "messages": [{"role": "user", "content": "hello"}],
        }
        await client.post("/v1/messages", json=anthropic_body)
        m = await client.post("/v1/messages", json=anthropic_body)
    cached = int(r.headers["x-cached-tokens"])
    assert cached > 0 and r.headers["x-session-cache"] == "prefix_hit"
    final = parse_sse(r.text)[-1][1]["response"]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == cached
    start = parse_sse(m.text)[0][1]["message"]["usage"]
    assert start["cache_read_input_tokens"] == int(m.headers["x-cached-tokens"]) > 0


async def test_cancelled_request_keeps_its_prefill(scripted: Server) -> None:
    from .conftest import RawConnection

    conn = await RawConnection.open(scripted)
    body = {
        "model": SCRIPTED,
        "instructions": SYSTEM,
        "input": "LOOP",
        "stream": True,
        "max_output_tokens": 10**6,
    }
    await conn.post_json("/v1/responses", body)
    await conn.read_until(b"output_text.delta")
    await conn.close()
    await wait_until(lambda: scripted.engine.stats.cancelled == 1, what="cancelled")
    await wait_until(lambda: len(scripted.engine.cache.index) > 0, what="snapshot indexed")
    async with scripted.client() as client:
        r = await client.post(
            "/v1/responses", json={**body, "stream": False, "max_output_tokens": 4}
        )
    assert int(r.headers["x-cached-tokens"]) >= r.json()["usage"]["input_tokens"] - 1


@pytest.mark.parametrize("dtype", ["model", "float32"])
async def test_cached_and_cold_greedy_generations_are_identical(dtype: str) -> None:
    """The correctness guard, on the embedded model through the real engine, in
    its stored bfloat16 and in the float32 that ``auto`` picks on a fast CPU."""
    warm = Engine(
        "warm",
        str(EMBEDDED_MODEL_PATH),
        EngineConfig(
            capacity=4,
            prefill_chunk=32,
            default_max_tokens=64,
            prefix_cache_bytes=1 << 30,
            compute_dtype=dtype,
        ),
    )
    cold = Engine(
        "cold",
        str(EMBEDDED_MODEL_PATH),
        EngineConfig(
            capacity=4,
            prefill_chunk=32,
            default_max_tokens=64,
            prefix_cache_bytes=0,
            compute_dtype=dtype,
        ),
    )
    await warm.start()
    await cold.start()
    try:
        tok = warm.tokenizer
        messages = [
            {"role": "system", "content": "Rules. " * 50},
            {"role": "user", "content": "first question"},
        ]

        async def run(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
            match = await engine.lookup(prompt)
            tokens: list[int] = []
            try:
                async with engine.submit(
                    prompt, SamplingParams(max_tokens=24), match=match
                ) as handle:
                    async for event in handle:
                        tokens.extend(event.token_ids)
            finally:
                engine.release(match)
            return tokens, handle.stats.cached_tokens

        first = tok.apply_chat_template(messages, add_generation_prompt=True)
        await run(warm, first)
        await wait_until(lambda: len(warm.cache.index) > 0, what="snapshot")
        second = tok.apply_chat_template(
            messages
            + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}],
            add_generation_prompt=True,
        )
        for prompt in (first, second):
            warm_out, cached = await run(warm, prompt)
            cold_out, cold_cached = await run(cold, prompt)
            assert cached > 0 and cold_cached == 0
            assert warm_out == cold_out
        assert (
            warm.loaded.dtype
            == cold.loaded.dtype
            == ("float32" if dtype == "float32" else "bfloat16")
        )
    finally:
        await warm.stop(1)
        await cold.stop(1)


async def test_prefix_cache_can_be_disabled(server_factory, scripted_model_path) -> None:
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, prefix_cache_bytes=0
    )
    async with server.client() as client:
        for _ in range(2):
            r = await client.post(
                "/v1/responses", json={"model": SCRIPTED, "instructions": SYSTEM, "input": "hi"}
            )
            assert r.headers["x-session-cache"] == "fresh"
    assert len(server.engine.cache.index) == 0


async def test_pinned_match_survives_eviction_while_queued(
    server_factory, scripted_model_path
) -> None:
    """A request waiting for a slot keeps its matched prefix even if others evict."""
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, capacity=1, prefix_cache_bytes=1_600_000
    )
    engine = server.engine
    async with server.client() as client:
        await client.post(
            "/v1/responses", json={"model": SCRIPTED, "instructions": SYSTEM, "input": "hi"}
        )
    prompt_tokens = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
    )
    match = await engine.lookup(prompt_tokens)
    assert match is not None and match.entry.pins == 1
    async with server.client() as client:  # push other snapshots through the budget
        for i in range(4):
            await client.post(
                "/v1/responses",
                json={"model": SCRIPTED, "instructions": f"Other {i}. " * 200, "input": "hi"},
            )
    assert engine.cache.index.stats.evictions > 0
    tokens: list[int] = []
    async with engine.submit(prompt_tokens, SamplingParams(max_tokens=8), match=match) as handle:
        async for event in handle:
            tokens.extend(event.token_ids)
    engine.release(match)
    assert handle.stats.cached_tokens == match.length
    await trio.lowlevel.checkpoint()
