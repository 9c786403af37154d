"""Models on demand: what a switch costs, and whether memory comes back.

    python benchmarks/model_switch.py [--switches 8] [--prompt 2000] [--out benchmarks/results/model_switch]

A server (``mlxtrio serve`` in a subprocess) serves a models directory of two
29 M-parameter random-weight Qwen3 copies, ``alpha`` and ``beta``, with
``--max-loaded-models 1``: every switch unloads one to load the other. Each
switch is ``POST /v1/models/load`` (timed: the unload and the load), then one
``/v1/responses`` turn with the same ~``--prompt``-token prompt for that model,
one output token (timed, with ``X-Cached-Tokens``): the first load of each
model is cold (weights read, the prompt prefilled), later ones reload the
weights and find the prompt's KV blocks in the model's disk tier. After each
switch: the server's resident memory (VmRSS, Linux) and the memory budget's
own figure for the weights held, from ``/health``. The server stays up between switches, so the RSS
column shows whether unloads give memory back (it should stay flat after the
first two loads).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _servers import wait_ready  # noqa: E402
from grammar_overhead import small_model  # noqa: E402


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def os_threads(pid: int) -> int | None:
    try:
        return len(list(Path(f"/proc/{pid}/task").iterdir()))
    except OSError:
        return None


def prompt_text(tokens: int) -> str:
    # About one token per short word with the embedded tokenizer.
    return " ".join(f"line {i} of the notes" for i in range(tokens // 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switches", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mlxtrio-switch-"))
    models = work / "models"
    models.mkdir()
    source = small_model()
    for name in ("alpha", "beta"):
        # Plain copies (new modification times): two models to the disk tier,
        # whose cache is named by the weights' names, sizes and times.
        shutil.copytree(source, models / name, copy_function=shutil.copy)
    port = 8700 + int(time.time()) % 200
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "mlxtrio", "serve", "--port", str(port),
        "--models-dir", str(models), "--max-loaded-models", "1",
        "--data-dir", str(work / "data"), "--keep-alive-seconds", "0",
    ]  # fmt: skip
    log = (work / "server.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_ready(url, "/health", proc)
        baseline = rss_bytes(proc.pid)
        print(f"server pid {proc.pid}, log {work / 'server.log'}; RSS at start {mib(baseline)}")
        print(f"{'switch':>6} {'model':6} {'load s':>7} {'turn s':>7} {'cached':>7} {'prompt':>7} "
              f"{'RSS':>9} {'threads':>7} {'weights':>12}")  # fmt: skip
        with httpx.Client(base_url=url, timeout=600) as client:
            for i in range(args.switches):
                model = ("alpha", "beta")[i % 2]
                started = time.perf_counter()
                loaded = client.post("/v1/models/load", json={"model": model})
                load_s = time.perf_counter() - started
                loaded.raise_for_status()
                started = time.perf_counter()
                turn = client.post(
                    "/v1/responses",
                    json={
                        "model": model,
                        "input": prompt_text(args.prompt),
                        "max_output_tokens": 1,
                    },
                )
                turn_s = time.perf_counter() - started
                turn.raise_for_status()
                usage = turn.json()["usage"]
                health = client.get("/health").json()
                row = {
                    "switch": i + 1,
                    "model": model,
                    "load_seconds": load_s,
                    "turn_seconds": turn_s,
                    "cached_tokens": int(turn.headers.get("x-cached-tokens", 0)),
                    "prompt_tokens": usage["input_tokens"],
                    "rss_bytes": rss_bytes(proc.pid),
                    "threads": os_threads(proc.pid),
                    "memory": health.get("memory"),
                }
                rows.append(row)
                used = (health.get("memory") or {}).get("weights_bytes")
                print(
                    f"{i + 1:>6} {model:6} {load_s:7.2f} {turn_s:7.2f} {row['cached_tokens']:>7} "
                    f"{row['prompt_tokens']:>7} {mib(row['rss_bytes']):>9} {row['threads'] or '-':>7} "
                    f"{mib(used):>12}",
                    flush=True,
                )
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    summary = summarise(rows, baseline)
    print(summary)
    if args.out:
        Path(args.out + ".json").write_text(
            json.dumps({"baseline_rss": baseline, "rows": rows}, indent=2)
        )
        Path(args.out + ".md").write_text(table(rows, baseline) + "\n" + summary + "\n")


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def summarise(rows: list[dict], baseline: int | None) -> str:
    cold = rows[:2]
    warm = rows[2:]
    lines = []
    if cold:
        lines.append(
            "cold (first load of each model): load "
            + ", ".join(f"{r['load_seconds']:.2f} s" for r in cold)
            + "; turn "
            + ", ".join(f"{r['turn_seconds']:.2f} s ({r['cached_tokens']} cached)" for r in cold)
        )
    if warm:
        loads = sorted(r["load_seconds"] for r in warm)
        turns = sorted(r["turn_seconds"] for r in warm)
        cached = min(r["cached_tokens"] for r in warm)
        lines.append(
            f"reloads ({len(warm)}): load median {loads[len(loads) // 2]:.2f} s, turn median "
            f"{turns[len(turns) // 2]:.2f} s, at least {cached} prompt tokens from the disk tier"
        )
    rss = [r["rss_bytes"] for r in rows if r["rss_bytes"]]
    if len(rss) > 2:
        lines.append(
            f"RSS: start {mib(baseline)}, after switch 2 {mib(rss[1])}, after switch {len(rss)} "
            f"{mib(rss[-1])} (growth over the reloads {mib(rss[-1] - rss[1])})"
        )
    return "\n".join(lines)


def table(rows: list[dict], baseline: int | None) -> str:
    out = [
        f"RSS at start: {mib(baseline)}",
        "",
        "| switch | model | load s | turn s | cached | prompt | RSS | threads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['switch']} | {r['model']} | {r['load_seconds']:.2f} | {r['turn_seconds']:.2f} | "
        f"{r['cached_tokens']} | {r['prompt_tokens']} | {mib(r['rss_bytes'])} | {r['threads']} |"
        for r in rows
    ]
    return "\n".join(out)


if __name__ == "__main__":
    main()
