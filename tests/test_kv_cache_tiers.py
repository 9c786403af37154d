"""The prefix cache at agent scale: shared blocks held once, a disk tier that
survives restarts and never serves a damaged block, and in-flight reuse of a
prefill that is still running or being cancelled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from mlxtrio.engine.cache.blocks import BLOCK_TOKENS
from mlxtrio.engine.config import EngineConfig
from mlxtrio.engine.engine import Engine
from mlxtrio.engine.types import SamplingParams
from mlxtrio.settings import EMBEDDED_MODEL_PATH

from .conftest import SCRIPTED, RawConnection, Server, start_server, wait_until

SHARED = "".join(f"Rule {i}: keep the build green and the diffs small. " for i in range(900))


def tail(i: int) -> str:
    return " ".join(f"session {i} note {j}" for j in range(60))


async def ask(server: Server, system: str, question: str) -> tuple[int, int, dict[str, str]]:
    """(prompt tokens, cached tokens, headers) of one non-streamed message."""
    async with server.anthropic() as client:
        raw = await client.messages.with_raw_response.create(
            model=SCRIPTED,
            max_tokens=8,
            system=system,
            messages=[{"role": "user", "content": question}],
        )
    usage = (await raw.parse()).usage
    cached = usage.cache_read_input_tokens or 0
    assert int(raw.headers["x-cached-tokens"]) == cached
    return usage.input_tokens + cached, cached, dict(raw.headers)


async def test_a_shared_system_prompt_is_held_once(server_factory, scripted_model_path) -> None:
    """Six conversations over one ~12k-token system prompt with their own
    ~300-token tails hold at most 1.5x the bytes of one, and each stays warm."""
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, prefix_cache_disk_bytes=0
    )
    index = server.engine.cache.index
    sizes = []
    for i in range(6):
        prompt_tokens, _, _ = await ask(server, SHARED + tail(i), "hi")
        await wait_until(lambda n=i: len(index) == n + 1, what="snapshot indexed")
        sizes.append(index.nbytes)
    assert prompt_tokens > 12_000
    assert sizes[-1] <= 1.5 * sizes[0], sizes
    # Every block but those holding a tail is shared by all six.
    assert index.shared_blocks <= prompt_tokens // BLOCK_TOKENS + 6 * 2
    for i in range(6):  # each conversation is still whole
        total, cached, _ = await ask(server, SHARED + tail(i), "hi")
        assert cached == total - 1


async def test_blocks_count_the_memory_they_hold(server_factory, scripted_model_path) -> None:
    """The index's bytes are the KV arrays really held: after the sequences
    are gone, MLX's active memory grew by about what the index counts."""
    import mlx.core as mx

    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, prefix_cache_disk_bytes=0
    )
    await ask(server, "warm up", "hi")
    index = server.engine.cache.index
    await wait_until(lambda: len(index) == 1, what="warm-up snapshot")
    before_memory, before_counted = mx.get_active_memory(), index.nbytes
    for i in range(4):
        await ask(server, SHARED + tail(i), "hi")
    await wait_until(lambda: len(index) == 5, what="snapshots")
    # The Trio side sees a sequence end before the engine thread drops its
    # batch's KV: wait for the thread to go idle and report its memory.
    stats = server.engine.stats
    await wait_until(
        lambda: stats.finished == 5 and stats.mlx_active_bytes == mx.get_active_memory(),
        what="engine idle",
    )
    grown, counted = mx.get_active_memory() - before_memory, index.nbytes - before_counted
    assert 0.8 * counted <= grown <= 1.2 * counted, (grown, counted)


def on_disk(model: str, data_dir: Path) -> dict[str, Any]:
    """Settings of a server whose successive runs share ``data_dir``."""
    return {"model": model, "model_name": SCRIPTED, "data_dir": str(data_dir)}


async def _spilled(server: Server, blocks: int) -> None:
    disk = server.engine.cache.index.disk
    assert disk is not None
    await wait_until(lambda: len(disk) >= blocks, timeout=30, what="blocks written to disk")


async def test_blocks_on_disk_survive_a_restart(scripted_model_path, tmp_path: Path) -> None:
    settings = on_disk(scripted_model_path, tmp_path)
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        total, cached, _ = await ask(server, SHARED, "first question")
        assert cached == 0
        await _spilled(server, total // BLOCK_TOKENS)
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        total, cached, headers = await ask(server, SHARED, "first question")
        assert cached >= 0.95 * total and cached == (total - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        assert headers["x-session-cache"] == "prefix_hit"
        # A second project: the same system prompt, another first message.
        other_total, other_cached, _ = await ask(server, SHARED, "another project entirely")
        assert other_cached >= 0.9 * other_total
        nursery.cancel_scope.cancel()


async def test_damaged_block_files_are_never_served(scripted_model_path, tmp_path: Path) -> None:
    settings = on_disk(scripted_model_path, tmp_path)
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        total, _, _ = await ask(server, SHARED, "question")
        await _spilled(server, total // BLOCK_TOKENS)
        names = list(server.engine.cache.index.disk._files)  # oldest (first block) first
        nursery.cancel_scope.cancel()
    flipped, data = damage(tmp_path, names[20], names[30])
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, **settings)
        _, cached, _ = await ask(server, SHARED, "question")
        assert cached == 20 * BLOCK_TOKENS  # everything before the damaged block
        disk = server.engine.cache.index.disk
        assert disk is not None and disk.corrupt == 1
        # The request prefilled the rest; the damaged block was written anew.
        await wait_until(lambda: names[20] in disk, what="rewritten")
        assert flipped.read_bytes() != data  # noqa: ASYNC240
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:  # the truncated one is found when reached
        server = await start_server(nursery, **settings)
        _, cached, _ = await ask(server, SHARED, "question")
        assert cached == 30 * BLOCK_TOKENS
        disk = server.engine.cache.index.disk
        assert disk is not None and disk.corrupt == 1
        nursery.cancel_scope.cancel()


def damage(data_dir: Path, flip: bytes, truncate: bytes) -> tuple[Path, bytes]:
    """Flip bits inside one block file and cut another short; returns the
    first's path and its damaged bytes."""
    flipped = next(data_dir.rglob(flip.hex() + ".safetensors"))
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's bytes
    flipped.write_bytes(bytes(data))
    truncated = next(data_dir.rglob(truncate.hex() + ".safetensors"))
    truncated.write_bytes(truncated.read_bytes()[:1000])
    return flipped, bytes(data)


LONG_TASK = {
    "model": SCRIPTED,
    "instructions": SHARED[:20_000],
    "input": "LOOP",
    "stream": True,
    "max_output_tokens": 10**6,
}


async def test_a_retry_after_a_hang_up_reuses_the_aborted_prefill(
    server_factory, scripted_model_path
) -> None:
    """Claude Code's retry: the stream is dropped mid-prefill and the same
    request comes back at once, without streaming; it starts from what the
    dropped one prefilled."""
    server = await slow_prefill(server_factory, scripted_model_path)
    engine = server.engine
    conn = await RawConnection.open(server)
    await conn.post_json("/v1/responses", LONG_TASK)
    await conn.read_until(b"response.created")
    await wait_until(lambda: prefilling(engine, 1000), what="prefilling")
    await conn.close()
    async with server.client() as client:
        r = await client.post(
            "/v1/responses", json={**LONG_TASK, "stream": False, "max_output_tokens": 2}
        )
    assert r.status_code == 200, r.text
    cached = int(r.headers["x-cached-tokens"])
    assert cached == r.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= 1000
    last = engine.stats.last_cancelled
    assert last is not None
    assert cached >= last.cached_tokens + last.prefilled_tokens - 1


async def test_a_request_joins_a_prefill_in_flight(server_factory, scripted_model_path) -> None:
    """Two requests with one long prefix: the second waits for the first's
    prefill instead of prefilling the same tokens beside it."""
    server = await slow_prefill(server_factory, scripted_model_path)
    engine = server.engine
    async with trio.open_nursery() as nursery, server.client() as client:
        first = await RawConnection.open(server)
        await first.post_json("/v1/responses", LONG_TASK)
        await first.read_until(b"response.created")
        await wait_until(lambda: prefilling(engine, 500), what="prefilling")
        r = await client.post(
            "/v1/responses",
            json={
                **LONG_TASK,
                "input": "another question",
                "stream": False,
                "max_output_tokens": 2,
            },
        )
        await first.close()
        nursery.cancel_scope.cancel()
    assert r.status_code == 200, r.text
    assert engine.stats.inflight_waits == 1
    usage = r.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= usage["input_tokens"] - 32


async def slow_prefill(server_factory: Any, model: str) -> Server:
    """A server that prefills in many small steps (a long prompt stays in
    flight long enough to hang up on, or to join)."""
    return await server_factory(
        model=model,
        model_name=SCRIPTED,
        prefill_chunk=32,
        prefill_step_seconds=0.001,
        prefix_cache_disk_bytes=0,
    )


def prefilling(engine: Engine, past: int) -> bool:
    """Whether a sequence is prefilling and has more than ``past`` tokens in
    its KV (the engine's progress, as the handle reports it)."""
    return any(past < h.prefilled < len(h.prompt) - 1 for h in engine._live if not h.done)


async def test_disk_blocks_give_the_same_greedy_output_as_cold(tmp_path: Path) -> None:
    """The correctness guard for the disk round trip, on the embedded model in
    its stored bfloat16: a prompt continued from blocks read back from disk
    (after a restart) generates exactly what a cold run does."""
    prompt: list[int] = []

    async def run(cache_bytes: int) -> tuple[list[int], int]:
        engine = Engine(
            "tiny",
            str(EMBEDDED_MODEL_PATH),
            EngineConfig(
                capacity=2,
                prefill_chunk=256,
                default_max_tokens=32,
                prefix_cache_bytes=cache_bytes,
                prefix_cache_disk_bytes=cache_bytes,
                cache_dir=tmp_path,
                compute_dtype="model",
            ),
        )
        await engine.start()
        try:
            if not prompt:
                messages = [
                    {"role": "system", "content": SHARED[:6000]},
                    {"role": "user", "content": "What is the first rule?"},
                ]
                prompt.extend(
                    engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                )
            match = await engine.lookup(prompt)
            tokens: list[int] = []
            try:
                async with engine.submit(prompt, SamplingParams(max_tokens=24), match=match) as h:
                    async for event in h:
                        tokens.extend(event.token_ids)
            finally:
                engine.release(match)
            if cache_bytes and engine.cache.index.disk is not None:
                need = len(prompt) // BLOCK_TOKENS
                await wait_until(lambda: len(engine.cache.index.disk) >= need, timeout=30)
            return tokens, h.stats.cached_tokens
        finally:
            await engine.stop(1)

    cold, cold_cached = await run(0)
    first, first_cached = await run(1 << 30)  # writes the blocks
    again, again_cached = await run(1 << 30)  # a restart: reads them back
    assert cold_cached == first_cached == 0
    assert again_cached == (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS > 0
    assert cold == first == again


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from .scripted_hybrid import KINDS, build_hybrid

    return {kind: str(build_hybrid(tmp_path_factory.mktemp(kind), kind)) for kind in KINDS}


@pytest.mark.parametrize("kind", ["ssm", "sliding"])
async def test_untrimmable_caches_are_reused_from_turn_boundaries(
    server_factory, hybrid_models: dict[str, str], kind: str
) -> None:
    """Recurrent (Qwen3.5-style) and sliding-window (Gemma 3) caches cannot be
    trimmed back to a shared prefix: each prompt is snapshotted where its
    system prompt ends and where the conversation ends, before the generation
    prompt; the next turn, and another conversation with the same system
    prompt, start there, with the greedy output of a cold run."""
    path = hybrid_models[kind]
    warm = await server_factory(model=path, model_name="hybrid", prefix_cache_disk_bytes=0)
    cold = await server_factory(model=path, model_name="hybrid", prefix_cache_bytes=0)
    assert warm.engine.loaded.generation_suffixes and not warm.engine.loaded.plain_kv

    async def turn(server: Server, messages: list[dict[str, str]]) -> tuple[Any, int]:
        async with server.anthropic() as client:
            raw = await client.messages.with_raw_response.create(
                model="hybrid",
                max_tokens=8,
                extra_body={"temperature": 0},
                system=SHARED[:1500],
                messages=messages,
            )
        return await raw.parse(), int(raw.headers["x-cached-tokens"])

    first = [{"role": "user", "content": "What is the first rule?"}]
    reply, cached = await turn(warm, first)
    assert cached == 0
    prompt_tokens = reply.usage.input_tokens
    index = warm.engine.cache.index
    await wait_until(lambda: len(index) == 3, what="system, boundary and end snapshots")
    boundary = sorted(len(e.tokens) for e in index._entries.values())[1]
    assert prompt_tokens - 16 <= boundary < prompt_tokens  # less the generation prompt
    # The client's record of the reply differs from what was generated (the
    # snapshot at its end cannot be used; the one at the boundary can).
    edited = {"role": "assistant", "content": "An edited reply."}
    second = [*first, edited, {"role": "user", "content": "Why?"}]
    warm_reply, warm_cached = await turn(warm, second)
    cold_reply, cold_cached = await turn(cold, second)
    assert warm_cached == boundary and cold_cached == 0
    # What the engine really started from, not only what the lookup promised.
    assert warm_reply.usage.cache_read_input_tokens == warm_cached
    # Another conversation with the same system prompt goes on where it ends.
    other = [{"role": "user", "content": "Something else entirely."}]
    (warm_reply, warm_cached), (cold_reply, _) = await turn(warm, other), await turn(cold, other)
    system_end = min(len(e.tokens) for e in index._entries.values())
    assert 0 < warm_cached == system_end < boundary
    assert warm_reply.usage.cache_read_input_tokens == warm_cached
    assert warm_reply.content == cold_reply.content
    assert warm_reply.content == cold_reply.content


def test_a_whole_snapshot_is_trimmed_to_the_length_asked() -> None:
    """A cache that cannot be cut into blocks but can be trimmed (a sliding
    window that has not wrapped yet) comes back holding exactly the prefix."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    from mlxtrio.engine.cache.kv_store import KVStore

    cache = RotatingKVCache(max_size=64)
    keys = mx.random.normal((1, 2, 40, 8))
    cache.update_and_fetch(keys, keys + 1)
    store = KVStore()
    kept = store.keep(7, [cache], [], 40)
    assert kept.trimmable and not kept.blocks
    rebuilt = store.cache_for(7, 30)
    assert rebuilt is not None and rebuilt[0].offset == 30
    assert mx.array_equal(rebuilt[0].state[0][..., :30, :], keys[..., :30, :])
    exact = store.cache_for(7, 40)
    assert exact is not None and exact[0].offset == 40


def test_block_directories_of_replaced_weights_are_removed(tmp_path: Path) -> None:
    from mlxtrio.engine.cache.disk_tier import open_tier

    old, _ = open_tier(tmp_path, "a" * 32, "/models/m (float32)")
    other, _ = open_tier(tmp_path, "b" * 32, "/models/other (float32)")
    (old / "cafe.safetensors").write_bytes(b"x")
    new, found = open_tier(tmp_path, "c" * 32, "/models/m (float32)")
    assert not old.exists() and other.exists() and new.exists() and found == []


def test_reads_ahead_are_bounded_across_concurrent_lookups() -> None:
    """Blocks read for requests that have not started are held beside the
    cache: a quarter of its budget at most, however many lookups read at once."""
    from mlxtrio.engine.cache.disk_index import DiskIndex
    from mlxtrio.engine.cache.prefix_index import PrefixIndex
    from mlxtrio.engine.types import Match

    disk = DiskIndex(1 << 30, lambda names: None)
    names = [bytes([i]) * 16 for i in range(8)]
    disk.added((name, 1000) for name in names)
    index = PrefixIndex(16_000, lambda ids: None, disk)  # room for 4 blocks read ahead
    first, second = (Match(None, 8 * BLOCK_TOKENS, tuple(names)) for _ in range(2))
    assert index.reserve_reads(first) == 4
    assert index.reserve_reads(second) == 0  # the first's reservation counts already
    index.release(first)
    assert index.reading_bytes == 0
    assert index.reserve_reads(second) == 4


async def test_an_unusable_cache_directory_leaves_the_memory_cache(
    server_factory, scripted_model_path, tmp_path: Path
) -> None:
    """A data dir where the disk tier cannot live (here, a file) costs the
    disk tier only: requests are served and the memory cache works."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")  # noqa: ASYNC240 - test setup
    server = await server_factory(
        model=scripted_model_path, model_name=SCRIPTED, data_dir=str(blocked), database_url="none"
    )
    assert server.engine.cache.reuse.disk_dir is None
    _, first, _ = await ask(server, SHARED[:3000], "hi")
    _, second, _ = await ask(server, SHARED[:3000], "hi")
    assert first == 0 and second > 0
