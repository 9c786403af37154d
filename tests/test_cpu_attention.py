"""The CPU attention (mlxtrio.engine.cpu_attention) against MLX's own, and
where it stands in for it."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from mlxtrio.engine import cpu_attention
from mlxtrio.engine.cpu_attention import MAX_QUERIES, attention, install


def _inputs(batch: int, heads: int, kv_heads: int, queries: int, keys: int):
    mx.random.seed(batch * 100 + heads * 10 + queries)
    q = mx.random.normal((batch, heads, queries, 64))
    k = mx.random.normal((batch, kv_heads, keys, 64))
    v = mx.random.normal((batch, kv_heads, keys, 64))
    return q, k, v


def _padded_mask(batch: int, queries: int, keys: int) -> mx.array:
    """What a batch cache gives: each row left-padded by its own amount,
    each query seeing up to itself (a row fully padded for one query too)."""
    columns = mx.arange(keys)[None, None, :]
    at = mx.arange(keys - queries, keys)[None, :, None]
    padding = mx.array([min(3 * row, keys) for row in range(batch)])[:, None, None]
    return ((columns >= padding) & (columns <= at))[:, None]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("queries", [1, 9])
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
        given = mx.broadcast_to(_padded_mask(batch, queries, 300), (batch, heads, queries, 300))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=given)
    got = attention(q, k, v, 0.125, given)
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=2e-5, rtol=1e-4).item()


def test_a_row_that_sees_nothing_is_not_nan() -> None:
    q, k, v = _inputs(1, 2, 2, 1, 20)
    mask = mx.zeros((1, 1, 1, 20), dtype=mx.bool_)
    assert not mx.isnan(attention(q, k, v, 0.125, mask)).any().item()


def test_installed_in_the_model_modules_and_used_on_the_cpu_only_for_what_it_handles() -> None:
    import mlx_lm.models.base as base
    import mlx_lm.models.qwen3 as qwen3

    install()
    assert install() >= 2  # idempotent
    wrapped = qwen3.scaled_dot_product_attention
    original = wrapped.replaces
    assert original is base.scaled_dot_product_attention.replaces
    calls: list[str] = []
    ours = cpu_attention.attention
    cpu_attention.attention = lambda *a: calls.append("ours") or ours(*a)  # type: ignore[assignment]
    try:
        q, k, v = _inputs(1, 4, 2, 1, 50)
        wrapped(q, k, v, None, scale=0.125, mask=None)
        long_q, _, _ = _inputs(1, 4, 2, MAX_QUERIES + 1, 50)
        wrapped(long_q, k, v, None, scale=0.125, mask="causal")  # a prefill chunk: MLX's
        sinks = mx.zeros((4,))
        wrapped(q, k, v, None, scale=0.125, mask=None, sinks=sinks)  # sinks: MLX's
    finally:
        cpu_attention.attention = ours  # type: ignore[assignment]
    assert calls == ["ours"]


def test_each_thread_gets_its_own_streams() -> None:
    q, k, v = _inputs(2, 4, 2, 1, 40)
    expected = attention(q, k, v, 0.125, None)
    mx.eval(q, k, v, expected)  # (what is still to compute belongs to this thread)
    results: list[mx.array] = []

    def on_another_thread() -> None:
        out = attention(q, k, v, 0.125, None)
        mx.eval(out)
        results.append(out)

    thread = threading.Thread(target=on_another_thread)
    thread.start()
    thread.join()
    assert results and mx.allclose(results[0], expected).item()
