"""Server overhead: raw mlx-lm decode speed vs one stream through the server.

    python benchmarks/engine_overhead.py [--model PATH] [--tokens 512] [--runs 3]

By default both sides run a random-weights copy of the embedded model (same
architecture and tokenizer), which never stops early, so every run decodes
exactly ``--tokens`` tokens.

1. Raw: ``mlx_lm.stream_generate`` in this process, decode tokens/s.
2. Server: ``mlxtrio serve`` in a subprocess, one streaming ``/v1/responses``
   request at a time over HTTP; tokens/s measured by the client from the first to
   the last text delta (what a user sees), plus the server's own figure.

Prints both and the ratio (goal: >= 0.9, i.e. under 10 % overhead). The two sides
never run at the same time, so they do not compete for cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _servers import wait_ready  # noqa: E402

import mlxtrio  # noqa: E402, F401  (before MLX: the raw side gets the server's BLAS)

PROMPT = "Write a long story about a server that never loses a response."


def random_weights_model() -> str:
    """The embedded model's architecture and tokenizer with seeded random weights."""
    out = Path(tempfile.mkdtemp(prefix="mlxtrio-bench-")) / "random-tiny"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "build_embedded_model.py"),
            "--seed",
            "0",
            "--out",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return str(out)


def raw_decode_tps(model_path: str, tokens: int, runs: int) -> float:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlxtrio.engine.precision import apply_compute_dtype

    model, tokenizer = load(model_path)
    # The server's default (auto) compute dtype, so both sides do the same arithmetic.
    dtype = apply_compute_dtype(model, "auto").dtype
    print(f"raw mlx-lm computes in {dtype}", flush=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    speeds = []
    for _ in range(runs + 1):  # the first run warms up
        sampler = make_sampler(0.0)
        responses = list(
            stream_generate(model, tokenizer, prompt, max_tokens=tokens, sampler=sampler)
        )
        speeds.append(responses[-1].generation_tps)
    return statistics.median(speeds[1:])


def server_decode_tps(model_path: str, tokens: int, runs: int, port: int) -> tuple[float, float]:
    env = {**os.environ, "MLXTRIO_LOG_LEVEL": "warning"}
    cmd = [
        sys.executable,
        "-m",
        "mlxtrio.cli",
        "serve",
        "--port",
        str(port),
        "--max-output-tokens",
        str(tokens),
    ]
    cmd += ["--model", model_path, "--model-name", "bench"]
    proc = subprocess.Popen(cmd, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, "/health", proc)
        with httpx.Client(base_url=base, timeout=300) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            client_speeds, server_speeds = [], []
            for _ in range(runs + 1):
                body = {
                    "model": model,
                    "input": PROMPT,
                    "stream": True,
                    "max_output_tokens": tokens,
                }
                first = last = None
                deltas = 0
                usage = {}
                with client.stream("POST", "/v1/responses", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        if event["type"] == "response.output_text.delta":
                            now = time.perf_counter()
                            first = first or now
                            last = now
                            deltas += 1
                        elif event["type"] in ("response.completed", "response.incomplete"):
                            usage = event["response"]["usage"]
                if first is None or last is None or last == first:
                    raise RuntimeError("no deltas received")
                # Tokens after the first over the time they took (same definition as mlx-lm).
                client_speeds.append((usage["output_tokens"] - 1) / (last - first))
                server_speeds.append(usage.get("decode_tokens_per_second", 0.0))
        return statistics.median(client_speeds[1:]), statistics.median(server_speeds[1:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="random",
        help="model path; default: a random-weights copy of the embedded model, which never "
        "stops early, so every run decodes exactly --tokens tokens",
    )
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=18431)
    args = parser.parse_args()
    if args.model == "random":
        args.model = random_weights_model()

    raw = raw_decode_tps(args.model, args.tokens, args.runs)
    client_tps, server_tps = server_decode_tps(args.model, args.tokens, args.runs, args.port)
    print(f"model: {args.model}")
    print(f"tokens per run: {args.tokens}, runs: {args.runs} (after one warm-up)")
    print(f"raw mlx-lm decode:            {raw:8.1f} tok/s")
    print(f"server, seen by HTTP client:  {client_tps:8.1f} tok/s")
    print(f"server, engine's own figure:  {server_tps:8.1f} tok/s")
    print(f"ratio client/raw: {client_tps / raw:.3f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
