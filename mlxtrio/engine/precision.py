"""Which floating-point type the engine computes in.

Checkpoints ship in bfloat16 (or float16), the right type on a GPU. MLX's CPU
backend, though, hands only float32 matrix products to the platform BLAS; half
precision goes through its own generic loops. With a real BLAS behind it
(Accelerate on macOS, OpenBLAS or MKL loaded into the process on Linux) float32
prefill is 4-6x faster on the CPU than the stored bfloat16 (measured on the
embedded model, ``benchmarks/agent_loop.py``), and it is what agent turns wait
for. Without one (the reference BLAS bundled in the ``mlx[cpu]`` wheel) float32
is *slower* for full-precision weights. Quantised models never go through the
BLAS (MLX has its own kernels), and there float32 activations and scales are
about 5x faster than bfloat16 on a CPU either way (prefill and decode alike,
measured on a 4-bit copy of the embedded model). So ``auto`` upcasts where it
pays, and only when the float32 weights fit well within memory.

Pure functions; :func:`apply_compute_dtype` must run on the engine thread (it
touches MLX arrays).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple, cast

from .. import blas as cpu_blas
from ..settings import COMPUTE_DTYPES, physical_memory

# auto upcasts only while the float32 weights stay under this share of RAM.
_MAX_WEIGHT_SHARE = 0.25


def fast_cpu_blas() -> str | None:
    """The optimised BLAS MLX's CPU backend multiplies with here (``accelerate``,
    ``openblas``, ``mkl``, or another library's file name), or None."""
    if sys.platform == "darwin":
        return "accelerate"
    path = cpu_blas.provider()
    if path is None:
        return None
    name = Path(path).name
    return next((kind for kind in ("mkl", "openblas", "blis") if kind in name), name)


def choose_compute_dtype(
    setting: str,
    *,
    stored: str,
    on_cpu: bool,
    blas: str | None,
    float32_weight_bytes: int,
    memory: int,
    quantized: bool = False,
) -> str | None:
    """The dtype to cast the model's floating weights to, or None to keep ``stored``.

    ``setting`` is one of ``COMPUTE_DTYPES``: ``model`` keeps the stored type, a
    type name forces it, ``auto`` picks float32 on a CPU with a fast BLAS or for
    a quantised model, when the float32 (floating) weights take at most a quarter
    of ``memory``.
    """
    if setting not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {setting!r})"
        )
    if setting == "model":
        return None
    if setting != "auto":
        return None if setting == stored else setting
    if stored == "float32" or not on_cpu or (blas is None and not quantized):
        return None
    if float32_weight_bytes > memory * _MAX_WEIGHT_SHARE:
        return None
    return "float32"


_DETECT = "detect"


def missing_blas_hint(dtype: str, on_cpu: bool, blas: str | None = _DETECT) -> str | None:
    """What to tell a Linux user whose model computes slowly for want of a BLAS
    (``blas``: what :func:`fast_cpu_blas` found, if the caller asked already)."""
    if dtype == "float32" or not on_cpu or not sys.platform.startswith("linux"):
        return None
    if (fast_cpu_blas() if blas == _DETECT else blas) is not None:
        return None
    return (
        "MLX computes this model several times faster on the CPU with an optimised "
        f"BLAS, which mlxtrio loads when it is installed: {cpu_blas.INSTALL_HINT}"
    )


class Precision(NamedTuple):
    dtype: str  # what the model now computes in
    upcast_reason: str | None  # why auto chose float32: the BLAS's name or "quantized"
    hint: str | None  # how to make it faster (see missing_blas_hint)


def apply_compute_dtype(model: Any, setting: str) -> Precision:
    """Cast ``model`` in place as :func:`choose_compute_dtype` says.

    Quantised weights are integers and stay as they are; only floating
    parameters (norms, embeddings, quantisation scales) are cast.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    floats = [v for _, v in params if mx.issubdtype(v.dtype, mx.floating)]
    quantized = any(v.dtype == mx.uint32 for _, v in params)  # packed quantised weights
    if not floats:
        return Precision("none", None, None)
    stored = str(floats[0].dtype).removeprefix("mlx.core.")
    blas = fast_cpu_blas()
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    target = choose_compute_dtype(
        setting,
        stored=stored,
        on_cpu=on_cpu,
        blas=blas,
        float32_weight_bytes=sum(v.size for v in floats) * 4,
        memory=physical_memory(),
        quantized=quantized,
    )
    if target is None:
        return Precision(stored, None, missing_blas_hint(stored, on_cpu, blas))
    model.set_dtype(getattr(mx, target))
    reason = (blas or "quantized") if setting == "auto" else None
    return Precision(target, reason, missing_blas_hint(target, on_cpu, blas))
