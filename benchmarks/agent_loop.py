"""Agent-loop time to first token: prefix cache on, off, and mlx_lm.server.

    python benchmarks/agent_loop.py [--model PATH] [--turns 10] [--openblas]
    python benchmarks/agent_loop.py --sessions 12 --turns 4 --servers mlxtrio,mlx_lm

A 10-turn agent conversation with a ~2k-token system prompt and tools, resent in
full every turn like Claude Code and Codex do, growing by a user message and an
assistant reply per turn (fixed texts, so all three servers see the same
conversation). For each server, one server process at a time, per-turn TTFT is
measured by the client as the wall time of a streamed request for *one* output
token (prefill, the first token, the end of the stream). The first visible delta
is not a fair mark: the tiny model's first tokens are often a tool call, which a
server holds back until it parses (or, cut at a few tokens, never shows), and
whitespace, which servers trim differently. Prints the table and the goal ratios:

* warm-turn TTFT with the cache / without it   (goal <= 0.2)
* warm-turn TTFT with the cache / mlx_lm.server (goal <= 0.5)

``--sessions N`` runs N such conversations (same system prompt and tools, each on
its own task) interleaved turn by turn, like a main agent with sub-agents or a
few agent windows on one server: a cache only helps if it keeps every one of
them warm until its next turn. ``--servers`` picks which of the three to run
(the uncached one takes ~15 s a turn).

``--openblas`` preloads Debian's OpenBLAS for every server (Linux), so all sides
multiply through the same BLAS. (mlxtrio loads it by itself when it is installed;
``mlx_lm.server`` does not. ``MLXTRIO_SYSTEM_BLAS=0`` in the environment keeps
mlxtrio on the wheel's reference BLAS too.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _servers import wait_ready  # noqa: E402

from mlxtrio.settings import EMBEDDED_MODEL_PATH  # noqa: E402

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
SERVERS = {"mlxtrio": "mlxtrio", "mlxtrio-nocache": "no cache", "mlx_lm": "mlx_lm.server"}

RULES = [
    "Read the relevant files before editing anything.",
    "Prefer small, reviewable changes and explain each one.",
    "Run the tests after every change and report the result.",
    "Never run destructive commands without asking first.",
    "Quote file paths exactly as they appear in the repository.",
    "Keep answers short; use lists for steps.",
]
TOOLS = [
    {
        "type": "function",
        "name": name,
        "description": desc,
        "parameters": {
            "type": "object",
            "properties": {arg: {"type": "string"}},
            "required": [arg],
        },
    }
    for name, desc, arg in [
        ("read_file", "Read a file from the workspace.", "path"),
        ("write_file", "Write a file in the workspace.", "path"),
        ("run_command", "Run a shell command and return its output.", "command"),
        ("search", "Search the repository for a pattern.", "query"),
        ("list_files", "List the files in a directory.", "path"),
    ]
]


def system_prompt(target_words: int = 1400) -> str:
    lines, words, i = [], 0, 0
    while words < target_words:
        rule = f"{i + 1}. {RULES[i % len(RULES)]} (section {i // len(RULES) + 1})"
        lines.append(rule)
        words += len(rule.split())
        i += 1
    return "You are a coding agent working in a user's repository.\n" + "\n".join(lines)


def conversation(turns: int, session: int = 0) -> list[list[dict]]:
    """The history sent at each turn of one session."""
    task = f"Task {session + 1}. " if session else ""
    history: list[dict] = []
    per_turn = []
    for t in range(turns):
        history.append(
            {
                "role": "user",
                "content": f"{task}Step {t + 1}: please look at module_{t}.py and tell me what the function handle_{t} does, then suggest one small improvement with a test.",
            }
        )
        per_turn.append(list(history))
        history.append(
            {
                "role": "assistant",
                "content": f"handle_{t} validates its input and writes a record. Improvement: reject empty names early; test: call handle_{t}('') and expect a ValueError.",
            }
        )
    return per_turn


def ttft_mlxtrio(url: str, model: str, system: str, history: list[dict], max_tokens: int) -> float:
    body = {
        "model": model,
        "instructions": system,
        "input": history,
        "tools": TOOLS,
        "stream": True,
        "max_output_tokens": max_tokens,
        "store": False,
    }
    return _time_stream(url + "/v1/responses", body)


def _time_stream(url: str, body: dict) -> float:
    """Seconds from sending ``body`` to the end of its SSE stream."""
    started = time.perf_counter()
    with httpx.Client(timeout=600) as client, client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass
    return time.perf_counter() - started


def ttft_mlx_lm(url: str, model: str, system: str, history: list[dict], max_tokens: int) -> float:
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
    ]
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, *history],
        "tools": tools,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return _time_stream(url + "/v1/chat/completions", body)


def run_server(
    kind: str,
    model_path: str,
    port: int,
    env: dict,
    turns: int,
    sessions: int,
    max_tokens: int,
    mlx_lm_cache_size: int | None = None,
) -> list[float]:
    """Per-turn TTFT, averaged over the sessions (turn t of every session, then t + 1)."""
    url = f"http://127.0.0.1:{port}"
    if kind == "mlx_lm":
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            model_path,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ]
        if mlx_lm_cache_size is not None:
            cmd += ["--prompt-cache-size", str(mlx_lm_cache_size)]
        ready, measure, model = "/v1/models", ttft_mlx_lm, model_path
    else:
        cmd = [
            sys.executable,
            "-m",
            "mlxtrio.cli",
            "serve",
            "--port",
            str(port),
            "--model",
            model_path,
            "--model-name",
            "bench",
            "--log-level",
            "warning",
        ]
        cmd += ["--prefix-cache-bytes", "0" if kind == "mlxtrio-nocache" else "-1"]
        ready, measure, model = "/health", ttft_mlxtrio, "bench"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, ready, proc)
        system = system_prompt()
        measure(
            url, model, "warm-up " + system[:200], [{"role": "user", "content": "hi"}], 2
        )  # load and compile
        histories = [conversation(turns, s) for s in range(sessions)]
        return [
            statistics.mean(
                measure(url, model, system, histories[s][t], max_tokens) for s in range(sessions)
            )
            for t in range(turns)
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(EMBEDDED_MODEL_PATH))
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=1, help="interleaved conversations")
    parser.add_argument("--max-tokens", type=int, default=1, help="output tokens per turn")
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help=f"comma-separated subset of {SERVERS}"
    )
    parser.add_argument("--port", type=int, default=18531)
    parser.add_argument(
        "--mlx-lm-prompt-cache-size",
        type=int,
        help="mlx_lm.server's --prompt-cache-size (its default: 10 entries)",
    )
    parser.add_argument(
        "--openblas", action="store_true", help=f"LD_PRELOAD {OPENBLAS} for every server"
    )
    args = parser.parse_args()

    env = {**os.environ}
    if args.openblas:
        if not Path(OPENBLAS).exists():
            sys.exit(f"{OPENBLAS} not found (apt-get install libopenblas0-pthread)")
        env["LD_PRELOAD"] = OPENBLAS
    kinds = [k for k in SERVERS if k in args.servers.split(",")]
    results = {
        kind: run_server(
            kind,
            args.model,
            args.port + i,
            env,
            args.turns,
            args.sessions,
            args.max_tokens,
            args.mlx_lm_prompt_cache_size,
        )
        for i, kind in enumerate(kinds)
    }
    report(results, args)


def report(results: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(
        f"model: {args.model}   turns: {args.turns}   sessions: {args.sessions}   "
        f"openblas: {args.openblas}   mlx_lm prompt cache size: "
        f"{args.mlx_lm_prompt_cache_size or 'default'}"
    )
    print(f"{'turn':>4}" + "".join(f"{SERVERS[k]:>15}" for k in results) + "   (TTFT, seconds)")
    for t in range(args.turns):
        print(f"{t + 1:>4}" + "".join(f"{results[k][t]:>15.3f}" for k in results))
    warm = {k: statistics.mean(v[1:]) for k, v in results.items()}
    print(
        f"warm turns (2..{args.turns}) mean TTFT: "
        + ", ".join(f"{SERVERS[k]} {v:.3f} s" for k, v in warm.items())
    )
    if "mlxtrio" in warm and "mlxtrio-nocache" in warm:
        ratio = warm["mlxtrio"] / warm["mlxtrio-nocache"]
        print(f"ratio cached / no cache:      {ratio:.3f}  (goal <= 0.2)")
    if "mlxtrio" in warm and "mlx_lm" in warm:
        print(
            f"ratio cached / mlx_lm.server: {warm['mlxtrio'] / warm['mlx_lm']:.3f}  (goal <= 0.5)"
        )


if __name__ == "__main__":
    main()
