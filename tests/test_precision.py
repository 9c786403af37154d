"""The compute-dtype choice (pure), and the detection of a fast CPU BLAS."""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

from mlxtrio.engine.precision import choose_compute_dtype, fast_cpu_blas, missing_blas_hint

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


def test_auto_upcasts_a_quantised_model_on_any_cpu() -> None:
    """MLX's quantised kernels do not use the BLAS; in float32 they are faster."""
    assert choose(blas=None, quantized=True) == "float32"
    assert choose(on_cpu=False, quantized=True) is None


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's BLAS choice")
def test_a_fast_blas_is_loaded_before_mlx() -> None:
    """Importing mlxtrio loads an optimised BLAS ahead of MLX, so MLX multiplies
    through it without LD_PRELOAD: the system OpenBLAS when installed, else the
    pip MKL of the cpu-blas extra; MLXTRIO_SYSTEM_BLAS=0 opts out."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    assert _detected({**env, "MLXTRIO_SYSTEM_BLAS": "0"}) == "None"  # the wheel's own BLAS
    installed = sorted(glob.glob("/usr/lib/*-linux-gnu/libopenblas.so.0"))
    pip_mkl = importlib.util.find_spec("mkl") is not None or _has_distribution("mkl")
    expected = "openblas" if installed else "mkl" if pip_mkl else "None"
    assert _detected({**env, "MLXTRIO_SYSTEM_BLAS": "auto"}) == expected
    if installed:  # an explicit path works too
        assert _detected({**env, "MLXTRIO_SYSTEM_BLAS": installed[0]}) == "openblas"


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's BLAS choice")
def test_health_names_the_blas_in_use() -> None:
    """``/health``'s ``blas`` says which library MLX multiplies with, found
    from the symbol MLX binds to (not from what happens to be mapped)."""
    code = "from mlxtrio import blas; print(blas.describe())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    described = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "MLXTRIO_SYSTEM_BLAS": "0"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert described == "reference (slow)"
    detected = _detected({**env, "MLXTRIO_SYSTEM_BLAS": "auto"})
    described = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    if detected == "mkl":
        assert described.startswith("MKL 20") and described.endswith("(pip)")
    elif detected == "openblas":
        assert described.startswith("OpenBLAS 0.") and described.endswith("(system)")


def test_a_linux_cpu_without_openblas_gets_a_hint() -> None:
    # float32 already, or a GPU: nothing to say
    assert missing_blas_hint("float32", on_cpu=True) is None
    assert missing_blas_hint("bfloat16", on_cpu=False) is None
    hint = missing_blas_hint("bfloat16", on_cpu=True)
    if sys.platform.startswith("linux") and fast_cpu_blas() is None:
        assert hint is not None and "apt-get install libopenblas0-pthread" in hint
        assert "mlxtrio[cpu-blas]" in hint
    else:
        assert hint is None


@pytest.mark.skipif(sys.platform != "darwin", reason="macOS only")
def test_macos_always_has_accelerate() -> None:
    assert fast_cpu_blas() == "accelerate"


async def test_a_quantised_model_is_served_in_float32(tmp_path) -> None:
    """A 4-bit copy of the embedded model, through mlx-lm's own converter and the
    real engine: ``auto`` computes it in float32 on the CPU, with or without a
    fast BLAS, and it generates."""
    import mlx.core as mx
    from mlx_lm import convert

    from mlxtrio.engine.config import EngineConfig
    from mlxtrio.engine.engine import Engine
    from mlxtrio.engine.types import SamplingParams
    from mlxtrio.settings import EMBEDDED_MODEL_PATH

    path = tmp_path / "tiny-4bit"
    convert(str(EMBEDDED_MODEL_PATH), str(path), quantize=True, q_group_size=64, q_bits=4)
    engine = Engine(
        "q4",
        str(path),
        EngineConfig(capacity=1, prefill_chunk=64, default_max_tokens=16, compute_dtype="auto"),
    )
    await engine.start()
    try:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello!"}], add_generation_prompt=True
        )
        tokens: list[int] = []
        async with engine.submit(prompt, SamplingParams(max_tokens=8)) as handle:
            async for event in handle:
                tokens.extend(event.token_ids)
    finally:
        await engine.stop(1)
    on_cpu = mx.default_device().type == mx.DeviceType.cpu  # a Mac's GPU keeps bfloat16
    assert engine.loaded.dtype == ("float32" if on_cpu else "bfloat16")
    assert tokens
