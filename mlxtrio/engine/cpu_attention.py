"""Attention for MLX's CPU backend (engine thread).

Why: on the CPU, ``mx.fast.scaled_dot_product_attention`` runs unfused (a
matmul, a softmax, a matmul) and MLX's ``exp`` is computed one element at a
time, on one core. At an agent's context lengths the softmax's exponentials
are then most of a step: measured on a 2-core x86-64 VM, a batch of 4 rows at
a 3,000-token context spends 2.7 of a layer's 7.2 ms in ``exp`` decoding one
token per row, and 24 of 31 ms scoring 9 (a speculative step); prefilling is
the same cost per element, over a whole chunk of queries. Here the softmax
computes its exponentials with a polynomial (float32 to within a few ulp, the
maximum subtracted first as always) in a kernel ``mx.compile`` fuses, and
splits its rows across one CPU stream per core. The matmuls are MLX's (a BLAS,
multithreaded already).

:func:`install` puts :func:`attention` in place of mlx-lm's (and mlx-vlm's)
``scaled_dot_product_attention`` in the model modules that call it, for the
CPU device only: what it does not handle (a quantized KV cache, attention
sinks, another device) goes to the function it replaced. Metal keeps MLX's
fused kernel.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

_LOG2E = 1.4426950408889634
# ln 2 in two parts (Cody-Waite): the remainder x - n ln2 stays exact in float32.
_LN2_HIGH, _LN2_LOW = 0.693359375, -2.12194440e-4
# e^r on [-ln2/2, ln2/2] (Cephes expf): 1 + r + r^2 * P(r).
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5)
# Queries per row up to which this is used: decode and verification steps.
# A prefill chunk's scores are too large to stay in a core's cache, and there
# MLX's one-pass softmax does better than several passes of a polynomial.
MAX_QUERIES = 16
_MAX_STREAMS = 4
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
    return p * mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)


def _softmax(scores: mx.array) -> mx.array:
    shifted = scores - scores.max(axis=-1, keepdims=True)
    weights = _exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def _masked_softmax(scores: mx.array, mask: mx.array) -> mx.array:
    # The finite minimum, not -inf: a row with nothing visible (left
    # padding) gets even weights instead of NaN, as MLX's own gives.
    return _softmax(mx.where(mask, scores, mx.finfo(mx.float32).min))


def _biased_softmax(scores: mx.array, bias: mx.array) -> mx.array:
    return _softmax(scores + bias)


_softmax_c = mx.compile(_softmax)
_masked_softmax_c = mx.compile(_masked_softmax)
_biased_softmax_c = mx.compile(_biased_softmax)


class _Streams(threading.local):
    """CPU streams beside the caller's, one per further core, made on first
    use by each thread (MLX's streams belong to the thread that made them)."""

    extra: list[Any] | None = None

    def get(self) -> list[Any]:
        if self.extra is None:
            cores = min(os.cpu_count() or 1, _MAX_STREAMS)
            self.extra = [mx.new_stream(mx.cpu) for _ in range(cores - 1)]
        # The caller's stream first (mlx-lm generates on a stream of its own).
        return [mx.default_stream(mx.cpu), *self.extra]


_streams = _Streams()


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


def _part(array: Any, axis: int, start: int, stop: int) -> Any:
    if array is None or not isinstance(array, mx.array) or array.ndim < 5:
        return array
    if array.shape[axis] == 1:
        return array
    index = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    return array[tuple(index)]


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Scaled dot-product attention of ``queries`` ``(B, heads, L, D)`` over
    ``keys``/``values`` ``(B, kv_heads, T, D)`` (grouped-query heads share
    theirs), ``mask`` as mlx-lm gives it (None, "causal", a boolean or an
    additive array)."""
    batch, heads, length, dim = queries.shape
    kv_heads, keys_len = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    grouped = _grouped_mask(mask, batch, kv_heads, rep, length, keys_len)
    # The rows to split across streams: batch rows, else kv heads.
    axis = 0 if batch > 1 else 1
    size = batch if axis == 0 else kv_heads
    streams = _streams.get()[:size]
    bounds = [size * i // len(streams) for i in range(len(streams) + 1)]
    outs = []
    for stream, start, stop in zip(streams, bounds, bounds[1:], strict=False):
        with mx.stream(stream):
            q = _part4(queries, axis, start, stop, rep)
            k, v = _part4(keys, axis, start, stop, 1), _part4(values, axis, start, stop, 1)
            rows, groups = q.shape[0], q.shape[1] // rep
            scores = (q * scale).reshape(rows, groups, rep * length, dim) @ k.swapaxes(-1, -2)
            scores = scores.astype(mx.float32).reshape(rows, groups, rep, length, keys_len)
            weights = _weights(scores, _part(grouped, axis, start, stop))
            weights = weights.astype(values.dtype).reshape(rows, groups, rep * length, keys_len)
            outs.append((weights @ v).reshape(rows, groups * rep, length, dim))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=axis)


def _part4(array: mx.array, axis: int, start: int, stop: int, per: int) -> mx.array:
    """Rows ``start:stop`` of ``array`` along ``axis`` (0: batch; 1: kv
    heads, of which ``array`` holds ``per`` heads each)."""
    if axis == 0:
        return array[start:stop]
    return array[:, start * per : stop * per]


def _weights(scores: mx.array, mask: Any) -> mx.array:
    if mask is None:
        return _softmax_c(scores)
    if mask.dtype == mx.bool_:
        return _masked_softmax_c(scores, mask)
    return _biased_softmax_c(scores, mask.astype(mx.float32))


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
        if _ours(queries, keys, cache, sinks):
            return attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.replaces = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _ours(queries: mx.array, keys: Any, cache: Any, sinks: Any) -> bool:
    """Plain float keys on the CPU, heads grouped evenly, no sinks."""
    return (
        sinks is None
        and isinstance(keys, mx.array)
        and not hasattr(cache, "bits")
        and "Quant" not in type(cache).__name__
        and queries.shape[2] <= MAX_QUERIES
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
