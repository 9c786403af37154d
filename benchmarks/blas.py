"""Which BLAS makes MLX's CPU backend fastest here: prefill and decode of the
embedded and the 29 M-parameter bench model (float32), one process per library.

    python benchmarks/blas.py [--lib NAME=PATH ...] [--out benchmarks/results/blas]

Candidates measured by default: none (the mlx[cpu] wheel's reference BLAS),
the pip MKL (the cpu-blas extra), the system OpenBLAS if installed. Others by
path, e.g. ``--lib cmeel-openblas=/path/libopenblas.so.0`` (a library that
needs others loaded first: ``--lib 'name=dep.so:lib.so'``). Each library is
loaded ahead of MLX exactly as the server loads it (``MLXTRIO_SYSTEM_BLAS``).
Prints a table; writes JSON and Markdown when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PROBE = r"""
import ctypes, json, os, sys, time
for dep in os.environ.get("BLAS_DEPS", "").split(":"):
    if dep:
        ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL)
import mlxtrio
from mlxtrio import blas
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

path, prompt_tokens, decode_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tokenizer = load(path)
model.set_dtype(mx.float32)
mx.random.seed(0)
# Ids within the vocabulary: an id past the embedding table reads out of bounds.
vocab = model.model.embed_tokens.weight.shape[0]
prompt = mx.random.randint(10, vocab, (prompt_tokens,)).tolist()
a = mx.random.normal((2048, 2048))
mx.eval(a @ a)
start = time.perf_counter(); mx.eval(a @ a); gemm = 2 * 2048**3 / (time.perf_counter() - start) / 1e9
def run():
    started = time.perf_counter(); first = None; n = 0
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=decode_tokens, prefill_step_size=512):
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return prompt_tokens / (first - started), (n - 1) / (end - first)
run()  # warm-up
prefill, decode = max(run() for _ in range(2))
print(json.dumps({"blas": blas.describe(), "gflops": gemm, "prefill": prefill, "decode": decode}))
"""


def candidates(extra: list[str]) -> dict[str, str]:
    import glob

    from mlxtrio.blas import _SYSTEM_OPENBLAS, _pip_mkl

    found = {"reference (none)": "0"}
    system = [p for pattern in _SYSTEM_OPENBLAS for p in sorted(glob.glob(pattern))]
    if system:
        found["system OpenBLAS"] = system[0]
    if _pip_mkl():
        found["pip MKL"] = _pip_mkl()[0]
    for item in extra:
        name, _, path = item.partition("=")
        found[name] = path
    return found


def measure(setting: str, model: str, prompt: int, decode: int) -> dict[str, float | str]:
    deps, _, library = setting.rpartition(":")
    env = {**os.environ, "MLXTRIO_SYSTEM_BLAS": library, "BLAS_DEPS": deps}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, model, str(prompt), str(decode)],
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(
            f"the probe for {library} failed ({out.returncode}):\n{out.stderr[-2000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", action="append", default=[], help="NAME=PATH (deps first, ':')")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args()
    from grammar_overhead import small_model

    from mlxtrio.settings import EMBEDDED_MODEL_PATH

    models = {"embedded": str(EMBEDDED_MODEL_PATH), "29M": small_model()}
    rows = []
    for name, setting in candidates(args.lib).items():
        for model_name, path in models.items():
            figures = measure(setting, path, args.prompt, args.decode)
            rows.append({"library": name, "model": model_name, **figures})
            print(
                f"{name:22} {model_name:9} {figures['blas']:30} sgemm {figures['gflops']:7.1f} "
                f"GFLOP/s  prefill {figures['prefill']:8.1f} tok/s  decode {figures['decode']:6.1f} tok/s",
                flush=True,
            )
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(rows, indent=2))
        lines = [
            "| library | model | as /health says | sgemm 2048² GFLOP/s | prefill tok/s | decode tok/s |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['library']} | {r['model']} | {r['blas']} | {r['gflops']:.1f} | "
            f"{r['prefill']:.0f} | {r['decode']:.1f} |"
            for r in rows
        ]
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
