"""Speculative decoding (issue #38): drafts from the conversation, verified in
the batch, each row rolled back on its own; exact where it must be.

End to end through the real server and the official SDKs on the embedded
model and the scripted model; the engine-level checks drive mlx-lm's real
``BatchGenerator`` with the speculative batch swapped in."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
import trio

from mlxtrio.engine.batch import new_generator
from mlxtrio.engine.image_tokens import KEY_BASE
from mlxtrio.engine.model import load_model
from mlxtrio.engine.speculation.drafts import WINDOW, PromptLookup
from mlxtrio.engine.speculation.policy import (
    MAX_DRAFT,
    START_CAP,
    RowDrafts,
    StepTimer,
    Switch,
    _AtCap,
    _Rates,
)
from mlxtrio.engine.speculation.rollback import RaggedBatchKVCache
from mlxtrio.engine.speculation.verify import Speculation
from mlxtrio.settings import EMBEDDED_MODEL_PATH, Settings, SettingsError

from .conftest import MODEL, SCRIPTED, RawConnection, Server, ServerFactory, wait_until

FILE = (Path(__file__).resolve().parent.parent / "mlxtrio" / "engine" / "loop.py").read_text()

# Prompts the embedded model answers partly by copying (the repeated sentence,
# the file), partly not: drafts are accepted, partly accepted and rejected.
PROMPTS = [
    "Write a python function that adds two numbers. " * 3,
    "Repeat this file exactly:\n" + FILE[:1500],
    "Say hello and tell me a story about a cat.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. " * 4,
    "List three colors.",
    "Repeat this file exactly:\n" + FILE[1500:2200],
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n" * 2,
    "Hi",
]


# -- drafts and policy (pure Python) ------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 4, 4])
    assert lookup.propose(3) == []  # "4 4" never occurred before
    lookup.append([5, 6])
    # The 4-gram "4 4 5 6" is new; "5 6" last occurred before "7 4 4".
    assert lookup.propose(3) == [7, 4, 4]
    assert lookup.propose(2, pending=(7,)) == [4, 4]
    assert lookup.propose(0) == []


def test_a_draft_never_proposes_an_images_key_tokens() -> None:
    """An image's run stands in a vision prompt as key tokens (ids above any
    vocabulary): a draft stops before them."""
    keys = [KEY_BASE + 7, KEY_BASE + 8]
    lookup = PromptLookup([5, 6, 1, 2, *keys, 9, 5, 6, 1])
    assert lookup.propose(4, (2,)) == []  # "5 6 1 2" was followed by the keys
    assert lookup.propose(4, (7,)) == []
    lookup = PromptLookup([5, 6, 1, 2, 4, *keys, 5, 6, 1])
    assert lookup.propose(4, (2,)) == [4]


def test_prompt_lookup_memory_is_bounded() -> None:
    lookup = PromptLookup(list(range(1000)) * (3 * WINDOW // 1000))
    lookup.append(range(2 * WINDOW))
    assert len(lookup._tokens) < 2 * WINDOW
    assert all(len(index) <= 2 * WINDOW for index in lookup._index.values())
    lookup.append([65000, 65001])
    assert lookup.propose(2) == [65002, 65003]


def test_a_row_drafts_more_while_accepted_and_pauses_when_never() -> None:
    row = RowDrafts()
    for _ in range(5):
        row.verified(row.limit(), row.k)
    assert row.k == MAX_DRAFT
    row.verified(row.limit(), 2)
    assert row.k == 3
    for _ in range(3):
        row.verified(row.limit(), 0)
    assert row.limit() == 0  # paused


def test_auto_narrows_then_stops_drafting_where_it_measures_slower() -> None:
    switch = Switch("auto")
    for _ in range(20):
        switch.observe(4, tokens=4, seconds=0.01, speculative=False)  # 400 tok/s
    caps = []
    while switch.allows(4):
        caps.append(switch.cap(4))
        # 380 tok/s, drafts adding a quarter: a narrower cap, costing less, may pay
        switch.observe(4, tokens=5, seconds=5 / 380, speculative=True)
    assert sorted(set(caps), reverse=True) == [START_CAP, 2, 1]
    assert switch.allows(1) and switch.cap(1) == START_CAP  # other widths unaffected
    assert [switch.step_cap(4) for _ in range(256)] == [0] * 256
    assert switch.step_cap(4) == 2  # measured again after the cool-down
    for _ in range(64):  # still slower (at 2, then 1): a longer rest
        switch.observe(4, tokens=5, seconds=5 / 380, speculative=True)
    assert [switch.step_cap(4) for _ in range(512)] == [0] * 512
    assert switch.step_cap(4) == 2


def test_auto_skips_caps_its_drafts_never_reached() -> None:
    """Halving a cap cannot help a width whose drafts are one token long
    (text that copies nothing): it stops drafting at once."""
    switch = Switch("auto")
    switch.observe(8, tokens=8, seconds=0.05, speculative=False)
    for _ in range(32):
        switch.observe(8, tokens=8, seconds=0.08, speculative=True, longest=1)
    assert not switch.allows(8)


@pytest.mark.parametrize(
    "accepted, speed, cap",
    [
        (2, 0.78, 0),  # drafts added ~2 %: no narrower cap could pay, rest at once
        (24, 0.78, 0),  # ~19 %: at half the cost, still slower
        (2, 0.9, START_CAP),  # not far enough below plain to judge after 16 steps
        (64, 0.78, START_CAP),  # drafts add too much to judge them on 16 steps
    ],
)
def test_a_cap_far_slower_than_plain_is_judged_early(accepted: int, speed: float, cap: int) -> None:
    """Measuring a losing cap is what drafting costs text that copies
    nothing: a cap far slower than plain steps whose drafts add little is
    judged after half the usual steps, and rests at once where no narrower
    cap could pay."""
    switch = Switch("auto")
    switch.observe(8, tokens=8, seconds=0.05, speculative=False)  # 160 tok/s
    tokens = 8 * 16 + accepted  # 16 steps of 8 rows, drafting up to 4 each
    switch.observe(8, tokens, tokens / (speed * 160), speculative=True, steps=16, longest=4)
    assert switch.cap(8) == cap


def test_a_tried_neighbour_far_slower_is_dropped_early() -> None:
    """Where cap 4 pays by a little (a GPU: verifying is nearly free, the
    drafts add a tenth), cap 8 is tried; far slower, it is dropped after 16
    steps and 4 is kept, tried against less often."""
    switch = Switch("auto")
    switch.observe(4, tokens=400, seconds=4.0, speculative=False)  # 100 tok/s
    tokens = round(4 * 8 * 1.1)  # windows of 8 steps at 4 rows, drafts adding a tenth
    while switch.cap(4) == START_CAP:
        switch.observe(4, tokens, tokens / 110, speculative=True, steps=8, longest=4)
    assert switch.cap(4) == 8
    for _ in range(2):
        switch.observe(4, tokens, tokens / 70, speculative=True, steps=8, longest=8)
    assert switch.cap(4) == START_CAP
    assert switch.rates[2].probe_every == 2 * 96


def test_rates_average_windows_so_a_stalled_one_does_not_outweigh_the_rest() -> None:
    """A window that something else stalled (5 plain steps taking ten times
    as long) counts as much as any other window of as many steps: pooling
    their tokens and seconds would give it ten times the weight."""
    switch = Switch("auto")
    switch.observe(2, tokens=10, seconds=0.1, speculative=False, steps=5)  # 100 tok/s
    switch.observe(2, tokens=10, seconds=1.0, speculative=False, steps=5)  # 10 tok/s
    assert switch.rates[1].plain == pytest.approx(55.0)  # pooled: 18.2


@pytest.mark.parametrize(
    "added, speed, cap",
    [
        (1.0, 0.78, 2),  # drafts doubled the tokens at 2.6x a plain step's cost: 2 may pay
        (0.5, 0.78, 0),  # they added half at 1.9x: even at half that extra cost, slower
        (0.1, 0.95, 0),  # a tenth at 1.16x: the same
    ],
)
def test_a_losing_cap_halves_only_where_a_narrower_one_may_pay(
    added: float, speed: float, cap: int
) -> None:
    """The narrower cap is tried only if it could pay as measured: at best
    its drafts add as many tokens, and a step's extra cost shrinks with its
    drafted positions."""
    switch = Switch("auto")
    switch.observe(8, tokens=8, seconds=0.05, speculative=False)  # 160 tok/s
    tokens = round(8 * 32 * (1 + added))  # 32 steps of 8 rows, drafting up to 4 each
    switch.observe(8, tokens, tokens / (speed * 160), speculative=True, steps=32, longest=4)
    assert switch.cap(8) == cap


@pytest.mark.parametrize("longest, cap", [(8, 4), (6, 4), (5, 4), (4, 2), (3, 2), (2, 1), (1, 0)])
def test_a_losing_cap_halves_below_what_its_drafts_reached(longest: int, cap: int) -> None:
    rates = _Rates(drafting=_AtCap(MAX_DRAFT, longest=longest))
    rates.plain_rate.add(100, 1.0, steps=1)
    rates.drafting.rate.add(99, 1.0, steps=1)  # a little slower, where drafts doubled the tokens
    rates.drafting.gain.add(1, 1, steps=1)
    rates._lose()
    assert (rates.cap if not rates.cooldown else 0) == cap  # 8, 4, 2, 1 only


@pytest.mark.parametrize(
    "rates, best",
    [
        # A CPU at a wide batch: each drafted position costs a lot.
        ({1: 150.0, 2: 200.0, 4: 170.0, 8: 120.0}, 2),
        # A GPU: verifying is nearly free, the longest drafts pay most.
        ({1: 120.0, 2: 150.0, 4: 200.0, 8: 260.0}, 8),
    ],
)
def test_auto_climbs_to_the_cap_that_measures_fastest(rates: dict[int, float], best: int) -> None:
    switch = Switch("auto")
    switch.observe(4, tokens=400, seconds=4.0, speculative=False)  # 100 tok/s
    held = []
    for _ in range(300):
        cap = switch.step_cap(4)
        held.append(cap)
        for _ in range(8):  # a window of steps whose drafts reach the cap
            switch.observe(4, tokens=round(rates[cap]), seconds=1.0, speculative=True, longest=cap)
    later = held[100:]
    assert max(set(later), key=later.count) == best
    assert later.count(best) > 0.75 * len(later)  # others tried now and then, not kept
    assert Switch("on").cap(64) == MAX_DRAFT and not Switch("off").allows(1)


def test_steps_are_timed_in_runs_without_their_first_step_or_other_work() -> None:
    """Plain steps overlap the next one's compute, so a step is timed from its
    start to the next's; a run's first step (it waits for, or leaves behind,
    the other kind's work) and a window with a prefill in it do not count."""
    now = [0.0]
    switch = Switch("on")
    timer = StepTimer(switch, clock=lambda: now[0])

    def steps(n: int, width: int, speculative: bool, seconds: float, tokens: int) -> None:
        for _ in range(n):
            timer.begin(width, speculative)
            timer.count(tokens, drafted=4 if speculative else 0)
            now[0] += seconds

    steps(1, 2, False, 5.0, 2)  # a run's first step: not counted
    steps(9, 2, False, 0.02, 2)  # 100 tok/s; the 8-step window closes at the 10th
    steps(1, 2, True, 0.5, 6)  # first of the speculative run: not counted
    assert switch.rates[1].plain == pytest.approx(100.0)
    steps(8, 2, True, 0.05, 10)  # 200 tok/s
    steps(2, 2, True, 0.05, 10)  # the window closes as the first of these begins
    assert switch.rates[1].speculative == pytest.approx(200.0)
    timer.begin(2, True)
    timer.count(10)
    now[0] += 5.0  # a prefill chunk ran after that step
    timer.spoil()
    steps(6, 2, True, 0.05, 10)  # the window with the prefill (3 steps) is dropped
    steps(1, 3, True, 0.05, 10)  # another width ends the run: its last 5 steps count
    assert switch.rates[1].speculative == pytest.approx(200.0)
    assert switch.rates[1].speculative_steps == 8 + 5
    assert switch.rates[1].drafting.longest == 4
    # Steps allowed to draft where no row had a draft: they say nothing.
    for _ in range(10):
        timer.begin(3, True)
        timer.count(3, drafted=0)
        now[0] += 0.05
    timer.begin(4, False)
    assert 2 not in switch.rates


def test_the_setting() -> None:
    assert Settings.from_env(environ={}).speculation == "auto"
    assert Settings.from_env(environ={"MLXTRIO_SPECULATION": "off"}).speculation == "off"
    with pytest.raises(SettingsError, match="speculation must be one of auto, on, off"):
        Settings.from_env(environ={"MLXTRIO_SPECULATION": "always"})


# -- the engine: mlx-lm's BatchGenerator with the speculative batch ------------------


@pytest.fixture(scope="module")
def embedded() -> Any:
    return load_model("embedded", str(EMBEDDED_MODEL_PATH), "model")


@pytest.fixture(scope="module")
def embedded_float32() -> Any:
    """The embedded model as a CPU with a fast BLAS computes it (see
    mlxtrio.engine.precision): the CPU attention and SwiGLU stand in for
    MLX's there, at every step width."""
    return load_model("embedded", str(EMBEDDED_MODEL_PATH), "float32")


def _generate(
    loaded: Any, prompts: list[list[int]], mode: str, later: int = 0, **options: Any
) -> dict:
    """Every prompt's tokens, final KV and finish reason, run together: the
    last ``later`` prompts join after 12 steps (while the first rows are
    ragged)."""
    speculation = None
    if mode != "off":
        speculation = Speculation(Switch(mode), lambda uid: True)
    gen = new_generator(loaded, 16, 64, 512, speculation)
    cap = options.get("max_tokens", 64)
    try:
        waves = [prompts[: len(prompts) - later], prompts[len(prompts) - later :]]
        uids = gen.insert(
            waves[0], max_tokens=[cap] * len(waves[0]), samplers=options.get("samplers")
        )
        out: dict[int, Any] = {uid: {"tokens": []} for uid in uids}
        steps = 0
        while any("finish" not in o for o in out.values()) or (later and steps <= 12):
            if later and steps == 12:
                joined = gen.insert(waves[1], max_tokens=[cap] * later)
                uids += joined
                out.update({uid: {"tokens": []} for uid in joined})
            _, responses = gen.next()
            steps += 1
            for r in responses:
                out[r.uid]["tokens"].append(r.token)
                if r.finish_reason:
                    out[r.uid].update(
                        finish=r.finish_reason, cache=r.prompt_cache, all_tokens=r.all_tokens
                    )
        if speculation is not None:
            for uid in uids:
                out[uid]["counts"] = speculation.take(uid)
        return {i: out[uid] for i, uid in enumerate(uids)}
    finally:
        gen.close()


def _prompts(loaded: Any, texts: list[str]) -> list[list[int]]:
    tokenizer = loaded.tokenizer
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True
            )
        )
        for t in texts
    ]


@pytest.mark.parametrize(
    ("later", "dtype"),
    [(0, "model"), (3, "model"), (3, "float32")],
    ids=["together", "joining-ragged-rows", "joining-ragged-rows-float32"],
)
def test_greedy_output_and_each_rows_kv_equal_without_drafts(
    request: pytest.FixtureRequest, later: int, dtype: str
) -> None:
    model = request.getfixturevalue("embedded" if dtype == "model" else "embedded_float32")
    prompts = _prompts(model, PROMPTS)
    plain = _generate(model, prompts, "off", later)
    drafted = _generate(model, prompts, "on", later)
    accepted = rejected = 0
    for i in plain:
        assert drafted[i]["tokens"] == plain[i]["tokens"], PROMPTS[i][:40]
        assert drafted[i]["all_tokens"] == plain[i]["all_tokens"]
        counts = drafted[i]["counts"]
        accepted += counts.accepted
        rejected += counts.drafted - counts.accepted
        # Rolled back row by row: the KV a row leaves behind is a plain run's.
        for mine, theirs in zip(drafted[i]["cache"], plain[i]["cache"], strict=True):
            assert mine.offset == theirs.offset
            assert mx.allclose(
                mine.keys[..., : mine.offset, :], theirs.keys[..., : theirs.offset, :], atol=1e-4
            ).item()
            assert mx.allclose(
                mine.values[..., : mine.offset, :],
                theirs.values[..., : theirs.offset, :],
                atol=1e-4,
            ).item()
    # Both paths were taken (in float32 the tiny model repeats its prompts
    # more faithfully: fewer drafts fail).
    assert accepted > 30 and rejected > (5 if dtype == "model" else 0)


def test_a_row_alone_equals_the_row_in_a_batch(embedded: Any) -> None:
    prompts = _prompts(embedded, PROMPTS[:4])
    together = _generate(embedded, prompts, "on")
    for i, prompt in enumerate(prompts):
        assert _generate(embedded, [prompt], "on")[0]["tokens"] == together[i]["tokens"]


def test_ragged_rollback_unit() -> None:
    """Rows trimmed by different amounts keep exactly their own tokens, and the
    next write lands at each row's own end."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    rows = []
    for length in (3, 5):
        kv = KVCache()
        data = mx.arange(length, dtype=mx.float32).reshape(1, 1, length, 1) + 100 * length
        kv.update_and_fetch(data, data)
        rows.append(kv)
    cache = RaggedBatchKVCache.of(BatchKVCache.merge(rows))
    written = mx.full((2, 1, 4, 1), -1.0)
    cache.update_and_fetch(written, written)
    cache.trim_rows([1, 3])
    assert cache.ends == [8, 6] and cache.offset.tolist() == [6, 6]
    step = mx.full((2, 1, 1, 1), 7.0)
    cache.update_and_fetch(step, step)
    assert cache.extract(0).keys.reshape(-1).tolist() == [300, 301, 302, -1, -1, -1, 7]
    assert cache.extract(1).keys.reshape(-1).tolist() == [500, 501, 502, 503, 504, -1, 7]
    mask = cache.make_mask(2)
    assert mask.shape == (2, 1, 2, 11)
    # Row 0 (left padding 2) ends at 9, row 1 at 7: each query sees its own
    # row from its padding up to itself.
    assert mask[0, 0, 0].tolist() == [False] * 2 + [True] * 8 + [False]
    assert mask[1, 0, 1].tolist() == [True] * 9 + [False] * 2


def test_sampled_output_keeps_its_distribution(tmp_path: Path) -> None:
    """A tiny vocabulary, temperature 1: the tokens drawn with drafts verified
    by the rejection rule are distributed as those drawn without (chi-square,
    two samples, every position), while drafts are both accepted and rejected."""
    from scipy.stats import chi2_contingency

    loaded = _tiny_vocabulary_model(tmp_path)
    from mlx_lm.sample_utils import make_sampler

    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    runs = 24
    samples: dict[str, list[list[int]]] = {"off": [], "on": []}
    drafted = accepted = 0
    for mode in samples:
        mx.random.seed(7 if mode == "off" else 11)
        for _ in range(runs):
            sampler = make_sampler(temp=1.0)
            out = _generate(loaded, [prompt] * 16, mode, max_tokens=10, samplers=[sampler] * 16)
            samples[mode].extend(o["tokens"] for o in out.values())
            if mode == "on":
                drafted += sum(o["counts"].drafted for o in out.values())
                accepted += sum(o["counts"].accepted for o in out.values())
    assert drafted > 300 and 0.1 < accepted / drafted < 0.95
    for position in range(10):
        table = [[sum(t[position] == v for t in samples[m]) for v in range(8)] for m in samples]
        seen = [v for v in range(8) if table[0][v] + table[1][v]]
        p_value = chi2_contingency([[row[v] for v in seen] for row in table])[1]
        assert p_value > 1e-4, (position, table)


def _tiny_vocabulary_model(tmp_path: Path) -> Any:
    """A random qwen3 over an 8-token vocabulary whose next-token distribution
    has mass on several tokens (sampled drafts are then partly accepted)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    config = json.loads((EMBEDDED_MODEL_PATH / "config.json").read_text())
    config.update(vocab_size=8, num_hidden_layers=1, tie_word_embeddings=True)
    mx.random.seed(3)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights = {k: v * 0.8 if "embed" in k else v for k, v in weights.items()}
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    loaded = load_model("embedded", str(EMBEDDED_MODEL_PATH), "model")
    # Its own model, and no end-of-sequence token among its 8.
    return replace(loaded, model=model, tokenizer=SimpleNamespace(eos_token_ids=[]))


# -- through the server ----------------------------------------------------------------


async def _answers(server: Server, api: str, texts: list[str], stream: bool) -> list[str]:
    answers: list[str] = [""] * len(texts)

    async def one(i: int) -> None:
        answers[i] = await _answer(server, api, texts[i], stream, max_tokens=48 + 8 * i)

    async with trio.open_nursery() as nursery:
        for i in range(len(texts)):
            nursery.start_soon(one, i)
    return answers


async def _answer(server: Server, api: str, text: str, stream: bool, max_tokens: int) -> str:
    if api == "messages":
        client = server.anthropic()
        messages = [{"role": "user", "content": text}]
        if stream:
            async with client.messages.stream(
                model=MODEL, max_tokens=max_tokens, messages=messages
            ) as s:
                return "".join([t async for t in s.text_stream])
        message = await client.messages.create(
            model=MODEL, max_tokens=max_tokens, messages=messages
        )
        return "".join(b.text for b in message.content if b.type == "text")
    client = server.openai()
    if stream:
        events = await client.responses.create(
            model=MODEL, input=text, stream=True, max_output_tokens=max_tokens
        )
        parts = [e.delta async for e in events if e.type == "response.output_text.delta"]
        return "".join(parts)
    response = await client.responses.create(model=MODEL, input=text, max_output_tokens=max_tokens)
    return response.output_text


@pytest.mark.parametrize("api", ["messages", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_greedy_equal_through_both_apis(
    server_factory: ServerFactory, api: str, stream: bool
) -> None:
    on = await server_factory(speculation="on", prefix_cache_bytes=0)
    off = await server_factory(speculation="off", prefix_cache_bytes=0)
    for texts in (PROMPTS[:1], PROMPTS):  # batch 1, then batch 8 with mixed lengths
        assert await _answers(on, api, texts, stream) == await _answers(off, api, texts, stream)
    assert on.engine.stats.accepted_tokens > 50
    assert off.engine.stats.draft_tokens == 0


async def test_seeded_sampling_is_reproduced(server_factory: ServerFactory) -> None:
    """A seeded request never drafts, so its seed gives the same text either way."""
    on = await server_factory(speculation="on")
    off = await server_factory(speculation="off")
    body = {
        "model": MODEL,
        "input": PROMPTS[0],
        "temperature": 1.0,
        "seed": 1234,
        "max_output_tokens": 40,
    }
    texts = []
    for server in (on, off):
        async with server.client() as client:
            texts.append((await client.post("/v1/responses", json=body)).json()["output_text"])
    assert texts[0] == texts[1]


async def test_visible_in_the_log_metrics_and_health(
    server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlxtrio.access")
    server = await server_factory(speculation="on")
    await _answers(server, "messages", PROMPTS, False)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "mlxtrio.access"]

    await wait_until(lambda: len(lines()) == len(PROMPTS), what="the access log lines")
    drafted = [line for line in lines() if " draft=" in line]
    assert drafted and all(" accepted=" in line for line in drafted)
    async with server.client() as client:
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).json()
    stats = server.engine.stats
    assert (
        f'mlxtrio_speculation_accepted_tokens_total{{model="{MODEL}"}} {float(stats.accepted_tokens)}'
        in metrics
    )
    speculation = health["models"][0]["speculation"]
    assert speculation["mode"] == "on" and speculation["accepted_tokens"] == stats.accepted_tokens
    assert 0 < speculation["acceptance_rate"] <= 1
    assert speculation["batch_widths"]["1"]["speculative_tokens_per_second"] > 0


async def test_tool_calls_stay_schema_valid_beside_drafting_rows(
    server_factory: ServerFactory, scripted_model_path: str
) -> None:
    """Tool calls held to their grammar share verification steps with rows
    that draft every step (the scripted loop; its call is one token, so this
    checks the batch around it: drafting inside a grammar is
    test_a_grammar_drafts_with_the_masks_it_would_have_stepped_with)."""
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, speculation="on")
    tools = [
        {
            "name": "get_weather",
            "description": "weather",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    client = server.anthropic()
    results: list[Any] = []

    async def looping() -> None:
        await client.messages.create(
            model=SCRIPTED, max_tokens=200, messages=[{"role": "user", "content": "LOOP forever"}]
        )

    async def calling() -> None:
        await wait_until(lambda: server.engine.stats.accepted_tokens > 10, what="drafting")
        results.append(
            await client.messages.create(
                model=SCRIPTED,
                max_tokens=200,
                tools=tools,
                messages=[{"role": "user", "content": "weather?"}],
            )
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(looping)
        nursery.start_soon(calling)
    (message,) = results
    call = next(b for b in message.content if b.type == "tool_use")
    assert call.name == "get_weather" and call.input == {"city": "Paris"}


async def test_hangup_mid_verification_idles_the_engine(
    server_factory: ServerFactory, scripted_model_path: str
) -> None:
    server = await server_factory(model=scripted_model_path, model_name=SCRIPTED, speculation="on")
    conn = await RawConnection.open(server)
    body = {
        "model": SCRIPTED,
        "input": "LOOP forever",
        "max_output_tokens": 1_000_000,
        "stream": True,
    }
    await conn.post_json("/v1/responses", body)
    await conn.read_until(b"response.output_text.delta")
    await wait_until(lambda: server.engine.stats.steps > 20, what="decoding")
    live = server.engine.stats.generated_tokens
    await conn.close()
    await wait_until(lambda: server.engine.stats.cancelled == 1, what="cancelled")
    assert server.engine.stats.cancel_latency_steps[-1] <= 2
    await wait_until(lambda: server.engine.active_sequences == 0, what="idle")
    last = server.engine.stats.last_cancelled
    assert last is not None and last.accepted_tokens > 0
    assert last.generated_tokens >= live
    steps = server.engine.stats.steps
    await trio.sleep(0.3)
    assert server.engine.stats.steps == steps  # nothing runs for the client that left


async def test_scripted_turns_equal_with_and_without_drafts(
    server_factory: ServerFactory, scripted_model_path: str
) -> None:
    """Every scripted turn (plain text, reasoning, tool calls, the loop) the
    same with drafts forced as without, run together."""
    servers = [
        await server_factory(model=scripted_model_path, model_name=SCRIPTED, speculation=mode)
        for mode in ("on", "off")
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    turns: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "LOOP"}], "max_tokens": 120},
        {"messages": [{"role": "user", "content": "weather?"}], "tools": tools},
        {"messages": [{"role": "user", "content": "TWO calls"}], "tools": tools},
        {"messages": [{"role": "user", "content": "think"}], "reasoning_effort": "high"},
    ]
    answers: list[list[Any]] = [[], []]

    async def run(i: int) -> None:
        client = servers[i].openai()

        async def one(turn: dict[str, Any]) -> None:
            r = await client.chat.completions.create(model=SCRIPTED, **turn)
            message = r.choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            answers[i].append((turn["messages"][0]["content"], message.content, calls))

        async with trio.open_nursery() as nursery:
            for turn in turns:
                nursery.start_soon(one, turn)

    for i in (0, 1):
        await run(i)
    assert sorted(answers[0], key=str) == sorted(answers[1], key=str)
    assert servers[0].engine.stats.accepted_tokens > 20  # the loop drafted


def test_a_grammar_drafts_with_the_masks_it_would_have_stepped_with() -> None:
    """Inside a tool call the grammar works out each draft position's mask
    ahead: they are the masks it computes token by token, the draft is cut
    where it leaves the grammar, and after the accepted tokens are counted in
    it goes on as if it had stepped through them."""
    import llguidance

    from mlxtrio.engine.processors.grammar_masks import GrammarProcessor
    from mlxtrio.grammar.calls import CallVocabulary, ToolGrammar, call_grammar

    loaded = load_model("embedded", str(EMBEDDED_MODEL_PATH), "model")
    tokenizer, start, end = loaded.tokenizer, loaded.tool_call_token, loaded.tool_call_end_token
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = call_grammar("json_tools", [ToolGrammar("get_weather", schema)], CallVocabulary(end))
    assert text is not None

    def fresh(seen: list[int]) -> GrammarProcessor:
        grammar = llguidance.LLMatcher(
            loaded.grammar_tokenizer, llguidance.LLMatcher.grammar_from_lark(text)
        )
        return GrammarProcessor(grammar, start, repeat=True, seen=seen)

    spell = lambda piece: list(tokenizer.encode(piece, add_special_tokens=False))  # noqa: E731
    call = spell('{"name": "get_weather", "arguments": {"city": "Oslo"}}') + [end]
    output = [start, *call, *spell(" done")]
    prompt, vocab = spell("Hello"), loaded.vocab_size

    def step(processor: GrammarProcessor, seen: list[int], at: int) -> mx.array:
        seen[:] = output[: max(0, at - 1)]  # the host is one step behind
        return processor(mx.array(prompt + output[:at]), mx.zeros((1, vocab)))[0]

    reference_seen: list[int] = []
    reference = fresh(reference_seen)
    masks = [step(reference, reference_seen, at) for at in range(len(output))]

    seen: list[int] = []
    drafting = fresh(seen)
    at = 0
    while at < 4:  # plain steps into the call
        assert mx.array_equal(step(drafting, seen, at), masks[at])
        at += 1
    # At call ``at`` the pending token is output[at - 1]; the draft: the next 6,
    # then a token the grammar refuses (EOS inside the call).
    eos = min(tokenizer.eos_token_ids)
    draft = [*output[at : at + 6], eos]
    seen[:] = output[: at - 1]
    planned = drafting.plan_draft([output[at - 1], *draft])
    assert planned == 6  # cut before EOS
    drafted = drafting.draft_logits(mx.zeros((planned, vocab)))
    for j in range(planned):  # position j + 1: after draft[j]
        assert mx.array_equal(drafted[j], masks[at + 1 + j]), j
    # Position 0 as the engine calls it, then 4 of the 6 accepted.
    assert mx.array_equal(step(drafting, seen, at), masks[at])
    drafting.skip(4)
    at += 5
    for later in range(at, len(output)):  # it goes on as the reference did
        assert mx.array_equal(step(drafting, seen, later), masks[later]), later
