"""The compute-dtype choice (pure), and the detection of a fast CPU BLAS."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from mlxtrio.engine.precision import choose_compute_dtype, fast_cpu_blas

GIB = 1 << 30


def choose(setting: str = "auto", **overrides) -> str | None:
    args = {
        "stored": "bfloat16",
        "on_cpu": True,
        "blas": "openblas",
        "float32_weight_bytes": 1 * GIB,
        "memory": 24 * GIB,
    }
    return choose_compute_dtype(setting, **{**args, **overrides})


def test_auto_upcasts_half_precision_on_a_cpu_with_a_fast_blas() -> None:
    assert choose() == "float32"
    assert choose(stored="float16") == "float32"


def test_auto_keeps_the_stored_type_where_float32_does_not_pay() -> None:
    assert choose(on_cpu=False) is None  # a GPU computes half precision natively
    assert choose(blas=None) is None  # the bundled reference BLAS: float32 is slower
    assert choose(float32_weight_bytes=7 * GIB) is None  # would not fit comfortably
    assert choose(stored="float32") is None


def test_explicit_settings_win() -> None:
    assert choose("model") is None
    assert choose("float32", on_cpu=False, blas=None) == "float32"
    assert choose("bfloat16") is None  # already stored so
    assert choose("float16") == "float16"
    with pytest.raises(ValueError, match="compute_dtype"):
        choose("fp8")


def _detected(env: dict[str, str]) -> str:
    code = "from mlxtrio.engine.precision import fast_cpu_blas; print(fast_cpu_blas())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's system BLAS")
def test_the_system_openblas_is_loaded_before_mlx() -> None:
    """Importing mlxtrio loads the system OpenBLAS (when installed) ahead of MLX,
    so MLX multiplies through it without LD_PRELOAD; MLXTRIO_SYSTEM_BLAS=0 opts out."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    assert _detected({**env, "MLXTRIO_SYSTEM_BLAS": "0"}) == "None"  # the wheel's own BLAS
    installed = sorted(glob.glob("/usr/lib/*-linux-gnu/libopenblas.so.0"))
    expected = "openblas" if installed else "None"
    assert _detected({**env, "MLXTRIO_SYSTEM_BLAS": "auto"}) == expected
    if installed:  # an explicit path works too
        assert _detected({**env, "MLXTRIO_SYSTEM_BLAS": installed[0]}) == "openblas"


@pytest.mark.skipif(sys.platform != "darwin", reason="macOS only")
def test_macos_always_has_accelerate() -> None:
    assert fast_cpu_blas() == "accelerate"
