"""Attention for MLX's CPU backend: decode and verification steps, and
prefill chunks in blocks of queries (engine thread).

Why: on the CPU, ``mx.fast.scaled_dot_product_attention`` runs unfused (a
matmul, a softmax, a matmul) and MLX's ``exp`` runs one element at a time on
one core, about 20-25 ns an element on x86-64. At an agent's context lengths
the softmax's exponentials are then most of a step. Here the softmax is
NumPy's, whose ``exp`` is vectorized, and each group of query heads that
shares its keys is scored in one matmul (MLX's, on the BLAS
:mod:`mlxtrio.blas` gave it). Measured on a 2-core x86-64 VM with the
benchmarks' copier model (8 layers, 8 query and 4 KV heads of 64) at a
3,000-token context: a step verifying 9 tokens for each of 4 rows 139 ms
with a polynomial ``exp`` in MLX operations (this module's previous
softmax) -> 75 ms; a decode step of 8 rows 54 -> 43 ms; of 4 rows, which
MLX's kernel computed before (under the previous :data:`MIN_SCORES`), 35 -> 31.

The softmax evaluates the scores (the model's graph up to that layer):
a step runs layer by layer on the CPU anyway. NumPy's matmul is not used:
its own BLAS's threads, spinning after each call, took the cores from
MLX's (a verification step 275 ms, median; 94 with one BLAS thread).

A prefill chunk (more than :data:`MAX_QUERIES` queries) is attended to in
blocks of that many queries, so that a block's scores stay small; under a
causal mask a block reads only the keys it sees. MLX's softmax had made
prefill on the CPU mostly exponentials: a 4,096-token prompt of the copier
model took ~15 s, its later 512-token chunks ~2 s each.

Not used (MLX's function is): under :data:`MIN_SCORES` scores, for a
quantized KV cache, attention sinks, or another device (Metal keeps MLX's
fused kernel).

:func:`install` puts :func:`attention` in place of mlx-lm's (and mlx-vlm's)
``scaled_dot_product_attention`` in the model modules that call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from . import stand_in

# Queries scored at once (more are taken in blocks of this many, each block
# evaluated before the next is scored): 16 queries of 8 heads at a 32k
# context are 16 MB of scores a row.
MAX_QUERIES = 16
# Fewer scores than this are MLX's: its one fused call costs less than the
# conversions (measured: one row decoding at a 3,000-token context, 24k
# scores a layer, the same either way; 4 rows, 96k, 35 -> 31 ms a step).
MIN_SCORES = 32 * 1024
_MASKED = np.finfo(np.float32).min
# Scores this far below their row's maximum weigh nothing: exp(-69) ~ 1e-30,
# so a weight they would get, even divided by a million keys' sum, stays
# a normal float32 and its share of the output is far below float32's
# precision. Below that they would give subnormal weights, which the BLAS
# multiplies many times slower: measured on the copier model (a sharp head,
# 5 % of the weights subnormal) a layer's attention took 5.6 ms for 4 rows
# verifying 8 tokens at a 2,500-token context, 2.3 with them zeroed; a
# decode step's 1.3 -> 0.8.
_NEGLIGIBLE = -69.0
_NAME = "scaled_dot_product_attention"


def _softmax(scores: mx.array, mask: Any) -> mx.array:
    """The softmax of float32 ``scores`` over their last axis, ``mask``
    applied, computed by NumPy. Evaluates ``scores`` and returns an evaluated
    array; NumPy releases the GIL while it computes."""
    weights = np.array(scores, dtype=np.float32)
    if mask is not None and mask.dtype == mx.bool_:
        # The finite minimum, not -inf: a row with nothing visible (left
        # padding) gets even weights instead of NaN, as MLX's own gives.
        np.copyto(weights, _MASKED, where=~np.asarray(mask))
    elif mask is not None:
        weights += np.asarray(mask.astype(mx.float32))
    with np.errstate(invalid="ignore"):  # a row an additive -inf mask hides: NaN, as MLX's
        weights -= weights.max(axis=-1, keepdims=True)
        np.copyto(weights, -np.inf, where=weights < _NEGLIGIBLE)
        np.exp(weights, out=weights)
        weights /= weights.sum(axis=-1, keepdims=True)
    return mx.array(weights)


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
    mlx-lm gives it (None, "causal", a boolean or an additive array that
    broadcasts to ``(B, heads, L, T)``). More than :data:`MAX_QUERIES`
    queries are taken in blocks of that many; evaluates them."""
    length = queries.shape[2]
    if length <= MAX_QUERIES:
        return _attend(queries, keys, values, scale, mask)
    blocks = []
    for start in range(0, length, MAX_QUERIES):
        end = min(start + MAX_QUERIES, length)
        seen_keys, seen_values, seen_mask = _seen_by(keys, values, mask, start, end, length)
        block = _attend(queries[:, :, start:end], seen_keys, seen_values, scale, seen_mask)
        # Now, so that its weights are freed before the next block's scores
        # (left lazy, every block's weights would be held until the end).
        mx.eval(block)
        blocks.append(block)
    return mx.concatenate(blocks, axis=2)


def _seen_by(
    keys: mx.array, values: mx.array, mask: Any, start: int, end: int, length: int
) -> tuple[mx.array, mx.array, Any]:
    """The keys, values and mask for queries ``start:end`` of ``length``."""
    if isinstance(mask, str):
        # "causal": the block's last query sees the keys up to itself, and
        # the block's queries are then the last keys, "causal" again.
        seen = keys.shape[2] - length + end
        return keys[:, :, :seen], values[:, :, :seen], mask
    if mask is not None and mask.ndim >= 2 and mask.shape[-2] == length:
        mask = mask[..., start:end, :]
    return keys, values, mask


def _attend(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """:func:`attention` of queries scored at once."""
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
        if _ours(queries, keys, values, cache, sinks, mask):
            return attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    return scaled_dot_product_attention


def _ours(queries: mx.array, keys: Any, values: Any, cache: Any, sinks: Any, mask: Any) -> bool:
    """Plain float keys on the CPU, heads grouped evenly, no sinks, enough
    scores to gain, and a mask we read as MLX does ("causal" only where the
    queries are the last keys: MLX's own aligns them otherwise)."""
    return (
        sinks is None
        and isinstance(keys, mx.array)
        and mx.issubdtype(keys.dtype, mx.floating)
        and isinstance(values, mx.array)
        and (not isinstance(mask, str) or (mask == "causal" and keys.shape[2] >= queries.shape[2]))
        and queries.shape[0] * queries.shape[1] * queries.shape[2] * keys.shape[2] >= MIN_SCORES
        and not hasattr(cache, "bits")
        and "Quant" not in type(cache).__name__
        and queries.shape[1] % keys.shape[1] == 0
        and mx.default_device() == mx.cpu
    )


def install() -> int:
    """Use :func:`attention` on the CPU in every model module loaded so far
    that calls mlx-lm's (or mlx-vlm's) attention function; returns how many
    modules do. Idempotent; call once a model is loaded (its modules are
    imported then)."""
    return stand_in.install(_NAME, ("mlx_lm.models.base", "mlx_vlm.models.base"), _wrap)
