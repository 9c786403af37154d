"""Nothing slow on the Trio loop, and no engine step that runs for long: prefix
lookups do linear work, and prefill is paced so that running streams keep
getting tokens while another prompt prefills.

Work is asserted by counting it, never by timing it (timings live in
``benchmarks/responsiveness.py``)."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import httpx
import trio

from mlxtrio.engine.cache.prefix_index import PrefixIndex
from mlxtrio.engine.cache.radix import RadixTree
from mlxtrio.engine.pacing import PrefillPacer
from mlxtrio.engine.types import Entry

from .conftest import SCRIPTED

# -- the radix tree ----------------------------------------------------------------


def _brute_force(store: dict[tuple[int, ...], Any], query: list[int]) -> tuple[list[Any], int]:
    on_path = sorted((len(k), v) for k, v in store.items() if list(k) == query[: len(k)])
    common = 0
    for key in store:
        n = 0
        while n < min(len(key), len(query)) and key[n] == query[n]:
            n += 1
        common = max(common, n)
    return on_path, common


def test_radix_tree_agrees_with_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(600):
        tree: RadixTree[tuple[int, ...]] = RadixTree()
        store: dict[tuple[int, ...], tuple[int, ...]] = {}
        for _ in range(25):
            key = tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 8)))
            if rng.random() < 0.65:
                tree.insert(list(key), key)
                store[key] = key
            else:
                assert tree.remove(list(key)) == store.pop(key, None)
            query = [rng.randint(0, 2) for _ in range(rng.randint(0, 9))]
            found = tree.match(query)
            on_path, common = _brute_force(store, query)
            assert found.on_path == on_path
            assert found.common == common
            if common:
                assert found.below is not None and list(found.below[:common]) == query[:common]
            assert len(tree) == len(store)
            assert sorted(tree.values()) == sorted(store.values())


@contextmanager
def counting_lines(*modules: str) -> Iterator[list[int]]:
    """Count the Python lines executed in ``modules`` (files ending so)."""
    count = [0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.endswith(modules):
            if event == "line":
                count[0] += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        yield count
    finally:
        sys.settrace(None)


def test_a_lookup_against_a_long_entry_is_linear_work() -> None:
    """The stall: a 33k-token cached entry and a new prompt sharing 3k of its
    tokens took one 2.5 s lookup on the Trio thread (mlx-lm's PromptTrie copies
    the path at every node). Now the lookup compares runs of tokens in C."""
    rng = random.Random(1)
    cached = [rng.randrange(4096) for _ in range(33_000)]
    prompt = cached[:3000] + [rng.randrange(4096) for _ in range(2000)]
    index = PrefixIndex(1 << 40, lambda ids: None)
    index.add(Entry(0, "k", cached, nbytes=1, trimmable=True))
    with counting_lines("radix.py", "prefix_cache.py") as lines:
        match = index.lookup("k", prompt)
    assert match is not None and match.length == 3000
    assert lines[0] < 300, lines[0]  # independent of the 33k/3k sizes (log of them)


# -- prefill pacing ----------------------------------------------------------------


def test_pacer_sizes_chunks_by_the_time_they_take() -> None:
    pacer = PrefillPacer(budget=0.25, max_chunk=2048)
    assert pacer.chunk(context=0) == pacer.first_chunk  # before any measurement
    # 512 tokens at ~1k context took 0.1 s: about 1280 tokens fit in 0.25 s.
    pacer.observe(tokens=512, seconds=0.1, context=1000)
    near = pacer.chunk(context=1000)
    assert 1100 <= near <= 1300
    # Further into the context every token costs more: the chunk shrinks.
    far = pacer.chunk(context=30_000)
    assert far < near / 5
    # Two prompts prefilled together share the budget.
    assert pacer.chunk(context=1000, rows=2) <= near // 2 + 16
    # Bounds hold whatever the measurements say.
    pacer.observe(tokens=16, seconds=30.0, context=60_000)
    assert pacer.chunk(context=60_000) == pacer.min_chunk
    pacer = PrefillPacer(budget=0.25, max_chunk=512)
    pacer.observe(tokens=512, seconds=0.001, context=0)
    assert pacer.chunk(context=0) == 512
    # With no stream waiting for the step, it may take four budgets.
    pacer = PrefillPacer(budget=0.25, max_chunk=8192)
    pacer.observe(tokens=512, seconds=0.1, context=1000)
    shared = pacer.chunk(context=1000, decoding=True)
    assert 3 * shared <= pacer.chunk(context=1000, decoding=False) <= 4 * shared + 16


async def test_running_streams_keep_decoding_while_a_long_prompt_prefills(
    server_factory, scripted_model_path
) -> None:
    server = await server_factory(
        model=scripted_model_path,
        model_name=SCRIPTED,
        prefill_step_seconds=0.005,
        prefill_chunk=128,
    )
    rng = random.Random(2)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    long_input = " ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(800))
    deltas = 0
    during: list[int] = []

    async def stream_forever(client: httpx.AsyncClient) -> None:
        nonlocal deltas
        body = {"model": SCRIPTED, "input": "LOOP", "stream": True, "max_output_tokens": 100_000}
        async with client.stream("POST", "/v1/responses", json=body) as response:
            async for line in response.aiter_lines():
                deltas += line.startswith("event: response.output_text.delta")

    async with server.client() as client, trio.open_nursery() as nursery:
        nursery.start_soon(stream_forever, client)
        with trio.fail_after(30):
            while deltas < 5:
                await trio.sleep(0.01)
        # Counted on the engine: the client may not have read the last few
        # deltas yet when the other response is back.
        stats = server.engine.stats
        steps_before, generated_before = stats.steps, stats.generated_tokens
        r = await client.post(
            "/v1/responses",
            json={"model": SCRIPTED, "input": long_input, "max_output_tokens": 1},
        )
        # Tokens generated meanwhile: the running stream's, and the one asked for.
        during = [stats.steps - steps_before, stats.generated_tokens - generated_before - 1]
        nursery.cancel_scope.cancel()
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["input_tokens"]
    steps, tokens_meanwhile = during
    # The prefill took many small steps, and the running stream got a token at
    # every one of them.
    assert prompt_tokens > 3000
    assert steps >= prompt_tokens // 128, (steps, prompt_tokens)
    assert tokens_meanwhile >= steps - 2, (tokens_meanwhile, steps)
