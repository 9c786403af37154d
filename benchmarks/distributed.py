"""One rank against two: the same model served by one process, then sharded
across two ranks on this machine (MLX's ring backend over loopback).

    python benchmarks/distributed.py [--model small|embedded|PATH] [--runs 3]
                                     [--out benchmarks/results/distributed.md]

Each side is ``python -m mlxtrio serve``; the two ranks are started as
``mlx.launch --backend ring --hosts 127.0.0.1`` starts them (MLX_RANK and a
hostfile), without mlx.launch itself, whose output-forwarding loop spins a
core (``--launcher mlx.launch`` to include it). Workloads, one at a time:

* decode: one request of ``--tokens`` tokens, the server's decode tokens/s;
* cold TTFT at about 1k and 4k prompt tokens (a fresh prompt each run: no
  prefix reuse), the server's time to first token;
* 4 concurrent requests: generated tokens per wall-clock second.

Prints a table with ratios (2 ranks / 1 rank) and writes it with the raw
figures (JSON) to ``--out``. On one host with two cores, two ranks split the
same cores and add a lock-step round and two collectives per layer to every
step: expect them slower. The point of ranks is capacity (a model that does
not fit one machine's memory), not speed here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _servers import wait_ready  # noqa: E402

PYTHON = sys.executable
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def model_path(name: str) -> tuple[str, str]:
    """(path, public name) for ``small`` (a random ~29 M-parameter Qwen3,
    which never stops early), ``embedded`` or a path."""
    if name == "small":
        from grammar_overhead import small_model

        return small_model(), "small"
    if name == "embedded":
        from mlxtrio.settings import EMBEDDED_MODEL_PATH

        return str(EMBEDDED_MODEL_PATH), "mlxtrio-tiny"
    return name, Path(name).name


def start(ranks: int, path: str, name: str, port: int, data: Path, launcher: str) -> list[Any]:
    """The server processes (rank 0 first, or mlx.launch alone)."""
    serve = ["-m", "mlxtrio", "serve", "--port", str(port), "--model", path, "--model-name", name]
    serve += ["--data-dir", str(data), "--log-level", "warning", "--prefix-cache-disk-bytes", "0"]
    if ranks == 1:
        return [subprocess.Popen([PYTHON, *serve])]
    if launcher == "mlx.launch":
        command = [str(Path(PYTHON).parent / "mlx.launch"), "--backend", "ring", "-n", str(ranks)]
        command += ["--hosts", "127.0.0.1", "--python", PYTHON, *serve]
        return [subprocess.Popen(command)]
    hosts = data / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
    env = {**os.environ, "MLX_HOSTFILE": str(hosts)}
    return [
        subprocess.Popen([PYTHON, *serve], env={**env, "MLX_RANK": str(rank)})
        for rank in range(ranks)
    ]


def prompt_of(tokens: int, nonce: int) -> str:
    """About ``tokens`` tokens of text that no earlier prompt starts with."""
    words = [WORDS[(nonce * 7 + i * 3) % len(WORDS)] for i in range(tokens)]
    return f"Request {nonce}: " + " ".join(words)


async def request(
    client: httpx.AsyncClient, name: str, text: str, max_tokens: int
) -> dict[str, Any]:
    body = {"model": name, "input": text, "max_output_tokens": max_tokens, "temperature": 0}
    r = await client.post("/v1/responses", json=body)
    r.raise_for_status()
    return dict(r.json()["usage"])


async def words_for(client: httpx.AsyncClient, name: str, tokens: int) -> int:
    """How many words of :func:`prompt_of` make about ``tokens`` prompt tokens."""
    body = {"model": name, "input": prompt_of(1000, 0)}
    r = await client.post("/v1/responses/input_tokens", json=body)
    r.raise_for_status()
    return round(tokens * 1000 / r.json()["input_tokens"])


async def measure(url: str, name: str, runs: int, tokens: int) -> dict[str, Any]:
    figures: dict[str, Any] = {"decode_tps": [], "ttft_1k": [], "ttft_4k": [], "batch4_tps": []}
    nonce = int(time.time())
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await request(client, name, "warm up", 8)
        words = {size: await words_for(client, name, size) for size in (1000, 4000)}
        for run in range(runs):
            usage = await request(client, name, "Tell me a long story.", tokens)
            figures["decode_tps"].append(usage["decode_tokens_per_second"])
            for size in (1000, 4000):
                nonce += 1
                usage = await request(client, name, prompt_of(words[size], nonce), 4)
                figures[f"ttft_{size // 1000}k"].append(usage["time_to_first_token_ms"] / 1000)
                figures.setdefault(f"prompt_{size // 1000}k", []).append(usage["input_tokens"])
            generated: list[int] = []

            async def one(i: int, run: int = run, generated: list[int] = generated) -> None:
                usage = await request(client, name, f"Story {run}-{i}, please.", tokens // 2)
                generated.append(usage["output_tokens"])

            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
            figures["batch4_tps"].append(sum(generated) / (time.perf_counter() - started))
    return figures


def serve_and_measure(ranks: int, args: argparse.Namespace, path: str, name: str) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mlxtrio-bench-") as data:
        procs = start(ranks, path, name, port, Path(data), args.launcher)
        try:
            wait_ready(f"http://127.0.0.1:{port}", "/health", procs[0])
            return trio.run(measure, f"http://127.0.0.1:{port}", name, args.runs, args.tokens)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)


ROWS = (
    ("decode_tps", "decode, 1 stream (tok/s)", True),
    ("ttft_1k", "cold TTFT, ~1k tokens (s)", False),
    ("ttft_4k", "cold TTFT, ~4k tokens (s)", False),
    ("batch4_tps", "4 concurrent requests (tok/s)", True),
)


def table(one: dict[str, Any], two: dict[str, Any]) -> str:
    """Medians, and how much faster two ranks are (below 1: slower)."""
    lines = ["| workload | 1 rank | 2 ranks | 2 ranks' speed-up |", "|---|---|---|---|"]
    for key, label, higher_is_better in ROWS:
        a, b = statistics.median(one[key]), statistics.median(two[key])
        if key.startswith("ttft_"):
            size = int(statistics.median(one["prompt_" + key.removeprefix("ttft_")]))
            label = f"cold TTFT, {size:,}-token prompt (s)"
        speedup = b / a if higher_is_better else a / b
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {speedup:.2f}x |")
    return "\n".join(lines)


def machine() -> str:
    import mlx.core as mx

    import mlxtrio
    from mlxtrio.engine.precision import fast_cpu_blas

    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
        f"MLX {mx.__version__} on {mx.default_device()}, BLAS: "
        f"{fast_cpu_blas() or 'MLX bundled reference'}, system BLAS preloaded: "
        f"{bool(mlxtrio.SYSTEM_BLAS)}, Python {platform.python_version()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="small, embedded or a path")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--launcher", choices=("direct", "mlx.launch"), default="direct")
    parser.add_argument("--out", type=Path, help="write the Markdown (and JSON) here")
    args = parser.parse_args()
    path, name = model_path(args.model)
    one = serve_and_measure(1, args, path, name)
    two = serve_and_measure(2, args, path, name)
    result = table(one, two)
    print(result)
    if args.out:
        raw = json.dumps({"model": args.model, "one_rank": one, "two_ranks": two}, indent=1)
        args.out.with_suffix(".json").write_text(raw + "\n")
        args.out.write_text(
            f"# One rank against two: {args.model} model\n\n"
            f"`python benchmarks/distributed.py --model {args.model} --runs {args.runs}` "
            f"(medians of {args.runs} runs; raw figures in "
            f"`{args.out.with_suffix('.json').name}`).\n\n"
            f"Machine: {machine()}.\n\n{result}\n"
        )


if __name__ == "__main__":
    main()
