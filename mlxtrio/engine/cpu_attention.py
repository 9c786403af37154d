"""Attention for MLX's CPU backend, for decode and verification steps
(engine thread).

Why: on the CPU, ``mx.fast.scaled_dot_product_attention`` runs unfused (a
matmul, a softmax, a matmul) and MLX's ``exp`` costs about 20-25 ns an
element on x86-64 (a few multiply-adds cost well under 1 ns). At an agent's
context lengths the softmax's exponentials are then much of a step: measured
on a 2-core x86-64 VM, a batch of 4 rows at a 3,000-token context spends 2.7
of a layer's 7.2 ms in ``exp`` decoding one token per row, and 24 of 31 ms
scoring 9 (a speculative step). Here the softmax computes its exponentials
with a polynomial (float32 to within a few ulp, the maximum subtracted first
as always), and each group of query heads that shares its keys is scored in
one matmul. Measured on that VM with the benchmarks' copier model: a step
verifying 9 tokens per row of 4 at that context 378-385 ms -> 216-263 ms,
of 1 row 108-113 -> 68-75 ms; a decode step of 4 rows about the same.

Not used (MLX's function is): under :data:`MIN_SCORES` scores, for more
than :data:`MAX_QUERIES` queries (a prefill chunk: its scores do not stay
in a core's cache, where a few passes of a polynomial cost more than MLX's
one pass of its exp - measured, no gain), for a quantized KV cache,
attention sinks, or another device (Metal keeps MLX's fused kernel). Fused with ``mx.compile`` it measured faster
still, but a shapeless compile of it corrupted memory (mllama's
cross-attention) and a compile per shape grows MLX's compile cache at every
decode step, so it runs as plain MLX operations.

:func:`install` puts :func:`attention` in place of mlx-lm's (and mlx-vlm's)
``scaled_dot_product_attention`` in the model modules that call it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

MAX_QUERIES = 16
# Fewer scores than this are MLX's: its one call beats the polynomial's
# two dozen operations (measured: one decode token at a 3,000-token context,
# 8 heads, 24k scores a layer: 30-32 ms a step with MLX's, 35-38 with this;
# 9 tokens, 216k scores: 108-113 -> 68-75 ms).
MIN_SCORES = 128 * 1024
_LOG2E = 1.4426950408889634
# ln 2 in two parts (Cody-Waite): the remainder x - n ln2 stays exact in float32.
_LN2_HIGH, _LN2_LOW = 0.693359375, -2.12194440e-4
# e^r on [-ln2/2, ln2/2] (Cephes expf): 1 + r + r^2 * P(r).
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5)
_NAME = "scaled_dot_product_attention"
_MODULES = ("mlx_lm.models.", "mlx_vlm.models.")


def _exp(x: mx.array) -> mx.array:
    """e^x for float32 ``x`` <= 0 (a softmax's shifted scores); what lies
    under e^-87 (never a softmax's weight that counts) is 0."""
    x = mx.maximum(x, -87.0)
    n = mx.floor(x * _LOG2E + 0.5)
    r = x - n * _LN2_HIGH - n * _LN2_LOW
    p = mx.array(_P[0], mx.float32)
    for c in _P[1:]:
        p = p * r + c
    p = p * (r * r) + r + 1.0
    # 2^n written straight into a float's exponent bits.
    return p * mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)


def _softmax(scores: mx.array, mask: Any) -> mx.array:
    """The softmax of float32 ``scores`` over their last axis, ``mask`` applied."""
    if mask is not None and mask.dtype == mx.bool_:
        # The finite minimum, not -inf: a row with nothing visible (left
        # padding) gets even weights instead of NaN, as MLX's own gives.
        scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
    elif mask is not None:
        scores = scores + mask.astype(mx.float32)
    weights = _exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def _grouped_mask(mask: Any, batch: int, kv_heads: int, rep: int, queries: int, keys: int) -> Any:
    """``mask`` (None, "causal", or an array that broadcasts to
    ``(batch, heads, queries, keys)``) shaped for scores grouped as
    ``(batch, kv_heads, rep, queries, keys)``."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": the queries are the last keys
        return mx.arange(keys)[None] <= mx.arange(keys - queries, keys)[:, None]
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, rep, *mask.shape[2:])


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Scaled dot-product attention of ``queries`` ``(B, heads, L, D)`` over
    ``keys``/``values`` ``(B, kv_heads, T, D)`` (grouped-query heads share
    theirs: each group's queries are scored in one matmul), ``mask`` as
    mlx-lm gives it (None, "causal", a boolean or an additive array)."""
    batch, heads, length, dim = queries.shape
    kv_heads, keys_len = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    grouped = _grouped_mask(mask, batch, kv_heads, rep, length, keys_len)
    scores = (queries * scale).reshape(batch, kv_heads, rep * length, dim) @ keys.swapaxes(-1, -2)
    scores = scores.astype(mx.float32).reshape(batch, kv_heads, rep, length, keys_len)
    weights = _softmax(scores, grouped).astype(values.dtype)
    weights = weights.reshape(batch, kv_heads, rep * length, keys_len)
    return (weights @ values).reshape(batch, heads, length, values.shape[-1])


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        if _ours(queries, keys, values, cache, sinks):
            return attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.replaces = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _ours(queries: mx.array, keys: Any, values: Any, cache: Any, sinks: Any) -> bool:
    """Plain float keys on the CPU, heads grouped evenly, no sinks, enough
    scores to gain and few enough queries to stay in cache."""
    return (
        sinks is None
        and isinstance(keys, mx.array)
        and mx.issubdtype(keys.dtype, mx.floating)
        and isinstance(values, mx.array)
        and queries.shape[2] <= MAX_QUERIES
        and queries.shape[0] * queries.shape[1] * queries.shape[2] * keys.shape[2] >= MIN_SCORES
        and not hasattr(cache, "bits")
        and "Quant" not in type(cache).__name__
        and queries.shape[1] % keys.shape[1] == 0
        and mx.default_device() == mx.cpu
    )


def _originals() -> list[Callable[..., Any]]:
    found = []
    for name in ("mlx_lm.models.base", "mlx_vlm.models.base"):
        module = sys.modules.get(name)
        function = getattr(module, _NAME, None) if module is not None else None
        found.append(getattr(function, "replaces", function))
    return [function for function in found if function is not None]


def install() -> int:
    """Use :func:`attention` on the CPU in every model module loaded so far
    that calls mlx-lm's (or mlx-vlm's) attention function; returns how many
    modules do. Idempotent; call once a model is loaded (its modules are
    imported then)."""
    originals = _originals()
    installed = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_MODULES):
            continue
        current = getattr(module, _NAME, None)
        if getattr(current, "replaces", None) in originals:
            installed += 1
        elif current is not None and any(current is f for f in originals):
            setattr(module, _NAME, _wrap(current))
            installed += 1
    return installed
