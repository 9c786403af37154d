"""The CPU attention (mlxtrio.engine.cpu_attention) against MLX's own, and
where it stands in for it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxtrio.engine import cpu_attention
from mlxtrio.engine.cpu_attention import MAX_QUERIES, MIN_SCORES, attention, install


def _inputs(batch: int, heads: int, kv_heads: int, queries: int, keys: int):
    mx.random.seed(batch * 100 + heads * 10 + queries)
    q = mx.random.normal((batch, heads, queries, 64))
    k = mx.random.normal((batch, kv_heads, keys, 64))
    v = mx.random.normal((batch, kv_heads, keys, 64))
    return q, k, v


def _padded_mask(batch: int, queries: int, keys: int) -> mx.array:
    """What a batch cache gives: each row left-padded by its own amount,
    each query seeing up to itself; the last row's first query sees nothing
    (padded past it)."""
    columns = mx.arange(keys)[None, None, :]
    at = mx.arange(keys - queries, keys)[None, :, None]
    padding = [3 * row for row in range(batch - 1)] + [keys - queries + 1]
    padding = mx.array(padding)[:, None, None]
    return ((columns >= padding) & (columns <= at))[:, None]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("queries", [1, 9, 16])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive", "per-head"])
def test_same_as_mlx(batch: int, heads: int, kv_heads: int, queries: int, mask: str) -> None:
    q, k, v = _inputs(batch, heads, kv_heads, queries, 300)
    given: object = None
    if mask == "causal":
        given = "causal"
    elif mask == "bool":
        given = _padded_mask(batch, queries, 300)
    elif mask == "additive":
        given = mx.where(_padded_mask(batch, queries, 300), 0.0, -1e9)
    elif mask == "per-head":
        given = mx.random.uniform(shape=(batch, heads, queries, 300)) > 0.3
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=given)
    got = attention(q, k, v, 0.125, given)
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=2e-5, rtol=1e-4).item()


@pytest.mark.parametrize("keys", [40, 300])  # a prompt's first chunk; a later one
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2)])
@pytest.mark.parametrize(
    "mask", ["none", "causal", "bool", "additive", "per-head", "window", "all-queries"]
)
def test_a_prefill_chunk_in_blocks_of_queries(
    keys: int, heads: int, kv_heads: int, mask: str
) -> None:
    """40 queries: blocks of 16, 16 and 8; under "causal" each block reads
    only the keys up to its last query."""
    queries = 40
    q, k, v = _inputs(2, heads, kv_heads, queries, keys)
    given: object = None
    if mask == "causal":
        given = "causal"
    elif mask == "bool":
        given = _padded_mask(2, queries, keys)
    elif mask == "additive":
        given = mx.where(_padded_mask(2, queries, keys), 0.0, -1e9)
    elif mask == "per-head":
        given = mx.random.uniform(shape=(2, heads, queries, keys)) > 0.3
    elif mask == "window":  # (L, T), as mlx-lm's create_causal_mask gives it
        from mlx_lm.models.base import create_causal_mask

        given = create_causal_mask(queries, keys - queries, window_size=24)
    elif mask == "all-queries":  # (B, 1, 1, T): one row of keys for every query
        given = (mx.arange(keys) >= mx.array([0, 5])[:, None])[:, None, None]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=given)
    got = attention(q, k, v, 0.125, given)
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=2e-5, rtol=1e-4).item()


def test_a_half_precision_prefill_chunk() -> None:
    q, k, v = (a.astype(mx.bfloat16) for a in _inputs(2, 8, 4, 37, 37))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = attention(q, k, v, 0.125, "causal")
    assert got.dtype == mx.bfloat16
    assert mx.allclose(got, expected, atol=1e-2, rtol=1e-2).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("queries", [1, 9])  # MLX's operations; NumPy
def test_half_precision_models(dtype: mx.Dtype, queries: int) -> None:
    q, k, v = (a.astype(dtype) for a in _inputs(2, 8, 4, queries, 200))
    mask = _padded_mask(2, queries, 200)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = attention(q, k, v, 0.125, mask)
    assert got.dtype == dtype
    assert mx.allclose(got, expected, atol=1e-2, rtol=1e-2).item()


def test_values_of_another_size_than_keys() -> None:
    """Multi-head latent attention (DeepSeek-V2 and others): keys of 192, values of 128."""
    mx.random.seed(7)
    q, k = mx.random.normal((1, 4, 3, 192)), mx.random.normal((1, 1, 50, 192))
    v = mx.random.normal((1, 1, 50, 128))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask="causal")
    got = attention(q, k, v, 0.1, "causal")
    assert got.shape == (1, 4, 3, 128)
    assert mx.allclose(got, expected, atol=2e-5, rtol=1e-4).item()


@pytest.mark.parametrize("mask", ["none", "bool"])
def test_a_sharp_head_gives_no_subnormal_weights(mask: str) -> None:
    """Scores spread over ~200 (a head that looks at one place): the weights
    far below the peak are zero, not subnormal floats (which the BLAS
    multiplies many times slower), and the output is still MLX's."""
    import numpy as np

    q, k, v = _inputs(2, 8, 4, 9, 400)
    q = q * 30.0
    given = _padded_mask(2, 9, 400) if mask == "bool" else None
    scores = (q * 0.125).reshape(2, 4, 18, 64) @ k.swapaxes(-1, -2)
    spread = mx.max(scores, axis=-1) - mx.min(scores, axis=-1)
    assert mx.min(spread).item() > 100  # the case in question
    grouped = cpu_attention._grouped_mask(given, 2, 4, 2, 9, 400)
    weights = np.asarray(cpu_attention._softmax(scores.reshape(2, 4, 2, 9, 400), grouped))
    tiny = np.finfo(np.float32).tiny
    assert not ((weights > 0) & (weights < tiny)).any()
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=given)
    got = attention(q, k, v, 0.125, given)
    assert mx.allclose(got, expected, atol=2e-5, rtol=1e-4).item()


def test_installed_in_the_model_modules_and_used_on_the_cpu_only_for_what_it_handles() -> None:
    import mlx_lm.models.base as base
    import mlx_lm.models.qwen3 as qwen3

    install()  # (stays installed for the session, as in a server)
    assert install() >= 2  # idempotent
    wrapped = qwen3.scaled_dot_product_attention
    original = wrapped.replaces
    assert original is base.scaled_dot_product_attention.replaces
    calls: list[str] = []
    ours = cpu_attention.attention
    cpu_attention.attention = lambda *a: calls.append("ours") or ours(*a)  # type: ignore[assignment]
    try:
        q, k, v = _inputs(1, 8, 2, 4, MIN_SCORES // 32)  # 8 heads x 4 queries
        wrapped(q, k, v, None, scale=0.125, mask=None)  # a verification step: ours
        few, _, _ = _inputs(1, 8, 2, 1, MIN_SCORES // 32)
        wrapped(few, k, v, None, scale=0.125, mask=None)  # a decode step of one row: MLX's
        long_q, _, _ = _inputs(1, 8, 2, MAX_QUERIES + 1, MIN_SCORES // 32)
        wrapped(long_q, k, v, None, scale=0.125, mask="causal")  # a prefill chunk: ours
        short_q, short_k, short_v = _inputs(1, 8, 2, 20, 20)
        wrapped(short_q, short_k, short_v, None, scale=0.125, mask="causal")  # short: MLX's
        # "causal" with fewer keys than queries: MLX aligns them its own way.
        wide_q, few_k, few_v = _inputs(1, 8, 2, 128, 64)  # 64k scores
        wrapped(wide_q, few_k, few_v, None, scale=0.125, mask="causal")
        sinks = mx.zeros((8,))
        wrapped(q, k, v, None, scale=0.125, mask=None, sinks=sinks)  # sinks: MLX's
    finally:
        cpu_attention.attention = ours  # type: ignore[assignment]
    assert calls == ["ours", "ours"]
