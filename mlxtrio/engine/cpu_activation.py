"""SwiGLU for MLX's CPU backend (engine thread).

Why: a SwiGLU MLP's gate goes through ``silu`` (``x * sigmoid(x)``), and on
the CPU MLX's ``exp`` runs one element at a time, about 18 ns an element
on x86-64, where NumPy's vectorized one takes under 1. Measured on a 2-core
x86-64 VM at the benchmarks' small model's width (MLP 1536): for 32 tokens
(4 rows verifying 7 drafted tokens each) 1.05 ms a layer -> 0.14; for a
512-token prefill chunk 16.5 -> 3.0; for 4 decoding rows 0.18 -> 0.08; for
one, 0.09 -> 0.08.

The gate is evaluated (the model's graph up to it: the CPU attention of
:mod:`.cpu_attention` already has most steps wait layer by layer), its
sigmoid computed by NumPy, and the product with the up projection left to
MLX. Results differ from MLX's by rounding (under 1e-6 for float32 inputs of
order 1).

Used for float32 gates (what a model computes in on a CPU with a fast BLAS,
see :mod:`.precision`) of any size: for one decoding row the trip through
NumPy costs what MLX's loop does, and a plain step then rounds exactly as a
verification step's wider one (speculative decoding's greedy output must
equal a plain run's). Not used (MLX's function is) for half-precision gates,
whose MLX result rounds between the sigmoid and the products, or on another
device (Metal keeps MLX's compiled kernel).

:func:`install` puts it in place of mlx-lm's (and mlx-vlm's) ``swiglu`` in
the model modules that import it (most dense and MoE models: Llama, Qwen,
Mistral, DeepSeek, GLM and others).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from . import stand_in

_NAME = "swiglu"


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``, the sigmoid's exponentials by NumPy. Evaluates
    ``gate``; NumPy releases the GIL while it computes."""
    values = np.array(gate.astype(mx.float32), copy=True)
    denominator = np.negative(values)
    # exp(-x) overflowing to inf gives silu(x) = -0, as it should; a -inf
    # gate gives NaN, as MLX's does.
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp(denominator, out=denominator)
        denominator += 1.0
        np.divide(values, denominator, out=values)
    return mx.array(values).astype(gate.dtype) * x


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def stand_in_swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if _ours(gate, x):
            return swiglu(gate, x)
        return original(gate, x)

    return stand_in_swiglu


def _ours(gate: Any, x: Any) -> bool:
    return (
        isinstance(gate, mx.array)
        and isinstance(x, mx.array)
        and gate.dtype == mx.float32
        and mx.default_device() == mx.cpu
    )


def install() -> int:
    """Use :func:`swiglu` on the CPU in every model module loaded so far that
    calls mlx-lm's (or mlx-vlm's) ``swiglu``; returns how many modules hold it.
    Idempotent; call once a model is loaded."""
    return stand_in.install(
        _NAME, ("mlx_lm.models.activations", "mlx_vlm.models.activations"), _wrap
    )
