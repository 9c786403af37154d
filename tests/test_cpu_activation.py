"""The CPU SwiGLU (mlxtrio.engine.cpu_activation) against MLX's own, and
where it stands in for it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import activations

from mlxtrio.engine import cpu_activation
from mlxtrio.engine.cpu_activation import install, swiglu

# MLX's, whether or not a loaded model installed ours in its place already.
mlx_swiglu = getattr(activations.swiglu, "replaces", activations.swiglu)


@pytest.mark.parametrize("shape", [(4, 1, 1536), (2, 9, 1024), (1, 512, 64)])
def test_same_as_mlx(shape: tuple[int, ...]) -> None:
    mx.random.seed(sum(shape))
    gate, up = mx.random.normal(shape) * 4, mx.random.normal(shape)
    got, expected = swiglu(gate, up), mlx_swiglu(gate, up)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert mx.allclose(got, expected, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_models(dtype: mx.Dtype) -> None:
    mx.random.seed(3)
    gate, up = (mx.random.normal((3, 2048)).astype(dtype) for _ in range(2))
    got, expected = swiglu(gate, up), mlx_swiglu(gate, up)
    assert got.dtype == dtype
    assert mx.allclose(got, expected, atol=1e-2, rtol=1e-2).item()


def test_extreme_gates_as_mlx() -> None:
    """exp(-x) overflowing (a large negative gate) gives -0, as silu's limit."""
    gate = mx.array([-1e4, -100.0, -30.0, 0.0, 30.0, 100.0, 1e4] * 1000)
    up = mx.full(gate.shape, 2.0)
    got = swiglu(gate, up)
    assert mx.allclose(got, mlx_swiglu(gate, up), atol=0, rtol=1e-5).item()
    assert got[:2].tolist() == [0.0, 0.0] and got[-1].item() == 2e4
    nan = swiglu(mx.array([float("nan")] * 4096), mx.ones((4096,)))
    assert mx.all(mx.isnan(nan)).item()


def test_installed_in_the_model_modules_and_used_on_the_cpu_only_for_what_it_handles() -> None:
    import mlx_lm.models.qwen3 as qwen3

    install()  # (stays installed for the session, as in a server)
    assert install() >= 2  # idempotent
    wrapped = qwen3.swiglu
    assert wrapped.replaces is activations.swiglu.replaces  # (the home module's too)
    calls: list[str] = []
    ours = cpu_activation.swiglu
    cpu_activation.swiglu = lambda *a: calls.append("ours") or ours(*a)  # type: ignore[assignment]
    try:
        wide = mx.ones((8, 1024))
        wrapped(wide, wide)  # a verification step's MLP: ours
        narrow = mx.ones((1, 1536))
        wrapped(narrow, narrow)  # one decoding row: ours too (rounds alike)
        half = mx.ones((8, 1024), dtype=mx.bfloat16)
        wrapped(half, half)  # half precision: MLX's (rounds in between)
    finally:
        cpu_activation.swiglu = ours  # type: ignore[assignment]
    assert calls == ["ours", "ours"]
