"""mlx_lm.server and mlxtrio side by side, in one run, on the same models.

    python benchmarks/side_by_side.py [--models embedded,small] [--servers mlx_lm,mlxtrio]
                                      [--out benchmarks/results] [--smoke]

Both servers are asked the same requests through the same endpoint, OpenAI
Chat Completions (``/v1/chat/completions``), one server process at a time on
a fresh data dir (they never compete for the cores), each with its own
defaults. Models: ``embedded`` (the 3 M-parameter model mlxtrio ships) and
``small`` (a ~29 M-parameter Qwen3, 8 layers, random weights, the embedded
tokenizer). Throughput runs use the model's random-weight twin (same
architecture, never stops early, so every request decodes what it asks for);
prompt-side workloads use the model itself. Workloads:

* ``decode``: one stream of ``--tokens`` tokens, tokens/s from the first to the
  last delta (the client's view); and raw mlx-lm (``stream_generate`` in this
  process, no server) for reference;
* ``ttft``: cold time to first token at ~1k, ~4k and ~16k prompt tokens (a
  fresh prompt each: nothing cached), the wall time of a one-token request;
* ``agent_loop``: a 10-turn agent conversation (~2k-token system prompt and
  tools, the whole history resent every turn, as Claude Code and Codex do):
  each turn's TTFT;
* ``sessions``: 12 such conversations interleaved turn by turn: the median
  TTFT of their later turns (does every one stay warm?);
* ``aggregate``: generated tokens per second with 1, 2, 4 and 8 concurrent streams
  (the median of three runs each);
* ``hangup_cpu``: CPU seconds the server burns in the 5 s after a client of a
  non-streaming request (a long prompt, a long answer) hangs up;
* ``health``: ``/health`` latency (median, p99) while 4 streams decode;
* ``gap``: the longest pause between two deltas of a running stream while
  another request's ~8k-token prompt prefills.

Writes, per model, ``side_by_side-<model>.json`` (raw figures),
``side_by_side-<model>.md`` (a table with ratios and the machine) and
``side_by_side-<model>.png`` (matplotlib, ``pip install -e '.[bench]'``).
``--smoke`` runs every workload tiny (a minute or two) to keep this script
from rotting; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _servers import wait_ready  # noqa: E402

import mlxtrio  # noqa: E402, F401  (before MLX: the server's BLAS for the raw figure)

PYTHON = sys.executable
SERVERS = ("mlx_lm", "mlxtrio")
WORDS = (
    "the server keeps many agent conversations warm while it decodes streams for "
    "clients that resend their whole history every turn and expect tools to work"
).split()


@dataclass
class Sizes:
    tokens: int = 256  # decode
    contexts: tuple[int, ...] = (1000, 4000, 16000)
    turns: int = 10
    sessions: int = 12
    session_turns: int = 3
    streams: tuple[int, ...] = (1, 2, 4, 8)
    stream_tokens: int = 128
    system_words: int = 1400
    gap_prompt: int = 8000
    runs: int = 3


SMOKE = Sizes(
    tokens=16,
    contexts=(200, 400),
    turns=3,
    sessions=2,
    session_turns=2,
    streams=(1, 2),
    stream_tokens=8,
    system_words=100,
    gap_prompt=300,
    runs=1,
)


# -- models ------------------------------------------------------------------------


def models(name: str) -> tuple[str, str]:
    """(the model, its random-weight twin) for ``embedded`` or ``small``, as
    float32 checkpoints: both servers then compute in the same type (mlxtrio
    would upcast a bfloat16 checkpoint on a CPU with a fast BLAS, mlx_lm.server
    would not), so the figures compare the servers, not their dtype choices."""
    from engine_overhead import random_weights_model
    from grammar_overhead import small_model

    from mlxtrio.settings import EMBEDDED_MODEL_PATH

    if name == "embedded":
        return float32_copy(str(EMBEDDED_MODEL_PATH)), float32_copy(random_weights_model())
    if name == "small":
        path = float32_copy(small_model())
        return path, path
    raise SystemExit(f"unknown model {name!r}: embedded or small")


def float32_copy(path: str) -> str:
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    out = Path(tempfile.mkdtemp(prefix="side-by-side-")) / (Path(path).name + "-f32")
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    model, _ = load_model(Path(path))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return str(out)


def peer_env() -> dict[str, str]:
    """mlx_lm.server multiplies through the same BLAS as mlxtrio (which loads
    the system OpenBLAS itself; the peer needs it preloaded)."""
    env = dict(os.environ)
    if mlxtrio.SYSTEM_BLAS:
        env["LD_PRELOAD"] = mlxtrio.SYSTEM_BLAS
    return env


# -- servers -----------------------------------------------------------------------


@dataclass
class Server:
    kind: str
    model: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server process (Linux)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def serving(kind: str, model: str, extra: tuple[str, ...] = ()) -> Iterator[Server]:
    """A warmed-up server of ``kind`` on ``model`` (``extra``: more flags)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=f"side-by-side-{kind}-") as data:
        if kind == "mlx_lm":
            cmd = [PYTHON, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
            ready = "/v1/models"
        else:
            cmd = [PYTHON, "-m", "mlxtrio", "serve", "--model", model, "--port", str(port)]
            cmd += ["--model-name", model, "--data-dir", data, "--log-level", "warning"]
            ready = "/health"
        cmd += list(extra)
        with (Path(data) / "log").open("wb") as log:
            env = peer_env() if kind == "mlx_lm" else None
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            wait_ready(f"http://127.0.0.1:{port}", ready, proc)
            server = Server(kind, model, port, proc)
            complete(server, [{"role": "user", "content": "warm up"}], 2)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- requests ----------------------------------------------------------------------


def body(server: Server, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict:
    return {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def complete(
    server: Server, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
) -> float:
    """Seconds a non-streaming request took."""
    started = time.perf_counter()
    with httpx.Client(timeout=3600) as client:
        r = client.post(
            server.url + "/v1/chat/completions", json=body(server, messages, max_tokens, **extra)
        )
    r.raise_for_status()
    return time.perf_counter() - started


@dataclass
class Streamed:
    started: float = 0.0
    deltas: list[float] = field(default_factory=list)  # arrival times of content deltas
    tokens: int = 0  # usage.completion_tokens, when the server gave it


def stream(server: Server, messages: list[dict[str, Any]], max_tokens: int, out: Streamed) -> None:
    payload = body(
        server, messages, max_tokens, stream=True, stream_options={"include_usage": True}
    )
    out.started = time.perf_counter()
    with httpx.Client(timeout=3600) as client:
        with client.stream("POST", server.url + "/v1/chat/completions", json=payload) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if (
                        delta.get("content")
                        or delta.get("reasoning_content")
                        or delta.get("reasoning")
                    ):
                        out.deltas.append(time.perf_counter())


def words(n: int, nonce: int) -> str:
    return f"[{nonce}] " + " ".join(WORDS[(nonce + i * 7) % len(WORDS)] for i in range(n))


def prompt_of(tokens: int, nonce: int, tokenizer: Any) -> str:
    """A text of about ``tokens`` tokens no earlier prompt shares a prefix with."""
    per_word = len(tokenizer.encode(words(1000, 0))) / 1000
    return words(int(tokens / per_word), nonce)


# -- workloads -----------------------------------------------------------------------


def decode(server: Server, sizes: Sizes) -> dict[str, Any]:
    rates = []
    for run in range(sizes.runs):
        out = Streamed()
        stream(server, [{"role": "user", "content": f"Story {run}, please."}], sizes.tokens, out)
        count = out.tokens or len(out.deltas)
        if len(out.deltas) >= 2:
            rates.append((count - 1) / (out.deltas[-1] - out.deltas[0]))
    return {"tokens_per_second": statistics.median(rates) if rates else None}


def ttft(server: Server, sizes: Sizes, tokenizer: Any) -> dict[str, Any]:
    return {
        str(n): complete(
            server, [{"role": "user", "content": prompt_of(n, 1000 + n, tokenizer)}], 1
        )
        for n in sizes.contexts
    }


def agent_messages(system: str, session: int, turns: int) -> list[list[dict[str, Any]]]:
    """Each turn's whole history (system, then user/assistant pairs)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        history.append(
            {"role": "user", "content": f"Session {session}, step {turn}: " + words(40, turn)}
        )
        out.append(list(history))
        history.append({"role": "assistant", "content": "Done: " + words(30, turn + 50)})
    return out


AGENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the workspace",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name in ("read_file", "write_file", "run_command", "search_code")
]


def agent_loop(server: Server, sizes: Sizes, system: str) -> dict[str, Any]:
    times = [
        complete(server, m, 1, tools=AGENT_TOOLS) for m in agent_messages(system, 0, sizes.turns)
    ]
    return {"turns": times}


def sessions(server: Server, sizes: Sizes, system: str) -> dict[str, Any]:
    plans = [agent_messages(system, s + 1, sizes.session_turns) for s in range(sizes.sessions)]
    later = []
    first = []
    for turn in range(sizes.session_turns):
        for plan in plans:
            seconds = complete(server, plan[turn], 1, tools=AGENT_TOOLS)
            (first if turn == 0 else later).append(seconds)
    return {"first_median": statistics.median(first), "later_median": statistics.median(later)}


def aggregate(server: Server, sizes: Sizes) -> dict[str, Any]:
    """The median over ``sizes.runs`` of each concurrency's tokens per second."""
    out = {}
    for n in sizes.streams:
        out[str(n)] = statistics.median(_concurrent(server, sizes, n) for _ in range(sizes.runs))
    return out


def _concurrent(server: Server, sizes: Sizes, n: int) -> float:
    """Generated tokens per wall-clock second of ``n`` streams at once."""
    runs, elapsed = concurrent_streams(server, n, sizes.stream_tokens, f"Tale {n}")
    return sum(r.tokens or len(r.deltas) for r in runs) / elapsed


def concurrent_streams(
    server: Server, n: int, max_tokens: int, tag: str
) -> tuple[list[Streamed], float]:
    """``n`` streams started at once (prompts ``{tag}-{i}``); each one's record
    and the wall-clock seconds until the last ended."""
    runs = [Streamed() for _ in range(n)]
    threads = [
        threading.Thread(
            target=stream,
            args=(server, [{"role": "user", "content": f"{tag}-{i}"}], max_tokens, r),
        )
        for i, r in enumerate(runs)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs, time.perf_counter() - started


def hangup_cpu(server: Server, sizes: Sizes, tokenizer: Any) -> dict[str, Any]:
    """Send a long non-streaming request over a raw socket, hang up after 1 s,
    and count the CPU the server uses in the next 5 s."""
    text = prompt_of(sizes.contexts[0], 77, tokenizer)
    payload = json.dumps(body(server, [{"role": "user", "content": text}], 4096)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head + payload)
    time.sleep(1.0)
    sock.close()
    before = server.cpu_seconds()
    time.sleep(5.0)
    after = server.cpu_seconds()
    burned = None if before is None or after is None else after - before
    # Let whatever still runs finish before the next workload.
    with httpx.Client(timeout=3600) as client:
        client.get(server.url + "/health")
    return {"cpu_seconds_after_hangup": burned}


def health(server: Server, sizes: Sizes) -> dict[str, Any]:
    runs = [Streamed() for _ in range(4)]
    threads = [
        threading.Thread(
            target=stream,
            args=(server, [{"role": "user", "content": f"Load {i}"}], sizes.tokens * 2, r),
        )
        for i, r in enumerate(runs)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    latencies = []
    with httpx.Client(timeout=60) as client:
        # at least a few samples, even when the load ends early (smoke sizes)
        while len(latencies) < 5 or (any(t.is_alive() for t in threads) and len(latencies) < 200):
            started = time.perf_counter()
            client.get(server.url + "/health")
            latencies.append(time.perf_counter() - started)
            time.sleep(0.05)
    for t in threads:
        t.join()
    latencies.sort()
    return {
        "median_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1000,
    }


def gap(server: Server, sizes: Sizes, tokenizer: Any) -> dict[str, Any]:
    """The longest pause of a running stream while another prompt prefills."""
    running = Streamed()
    thread = threading.Thread(
        target=stream,
        args=(server, [{"role": "user", "content": "Keep going."}], sizes.tokens * 4, running),
    )
    thread.start()
    while len(running.deltas) < 5 and thread.is_alive():
        time.sleep(0.01)
    started = time.perf_counter()
    complete(server, [{"role": "user", "content": prompt_of(sizes.gap_prompt, 99, tokenizer)}], 1)
    ended = time.perf_counter()
    thread.join()
    window = [t for t in running.deltas if started <= t <= ended + 1]
    pauses = [b - a for a, b in zip(window, window[1:], strict=False)]
    return {"max_gap_s": max(pauses) if pauses else ended - started, "prefill_s": ended - started}


def raw_decode(twin: str, sizes: Sizes) -> float:
    """mlx-lm's own decode speed in this process, for reference (not a bound:
    a server's batched loop may beat ``stream_generate``)."""
    from engine_overhead import raw_decode_tps

    return raw_decode_tps(twin, sizes.tokens, sizes.runs)


# -- one model, every server ------------------------------------------------------------


def run_model(name: str, servers: list[str], sizes: Sizes) -> dict[str, Any]:
    from mlx_lm import load

    model, twin = models(name)
    _, tokenizer = load(model)
    system = words(sizes.system_words, 5)
    results: dict[str, Any] = {"raw_decode_tokens_per_second": raw_decode(twin, sizes)}
    for kind in servers:
        log(f"{name}: {kind}")
        figures: dict[str, Any] = {}
        with serving(kind, twin) as server:
            figures["decode"] = decode(server, sizes)
            figures["aggregate"] = aggregate(server, sizes)
            figures["health"] = health(server, sizes)
            figures["hangup_cpu"] = hangup_cpu(server, sizes, tokenizer)
            figures["gap"] = gap(server, sizes, tokenizer)
        with serving(kind, model) as server:
            figures["ttft"] = ttft(server, sizes, tokenizer)
            figures["agent_loop"] = agent_loop(server, sizes, system)
            figures["sessions"] = sessions(server, sizes, system)
        results[kind] = figures
    return results


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- reporting ------------------------------------------------------------------------


Row = tuple[str, Callable[[dict[str, Any]], float | None], bool]  # label, value, higher is better


def rows(sizes: Sizes) -> list[Row]:
    out: list[Row] = [
        ("decode, 1 stream (tok/s)", lambda f: f["decode"]["tokens_per_second"], True)
    ]
    for n in sizes.contexts:
        out.append((f"cold TTFT, ~{n:,} tokens (s)", lambda f, n=n: f["ttft"][str(n)], False))
    out += [
        ("agent loop: first turn TTFT (s)", lambda f: f["agent_loop"]["turns"][0], False),
        (
            "agent loop: median later turn TTFT (s)",
            lambda f: statistics.median(f["agent_loop"]["turns"][1:]),
            False,
        ),
        (
            f"{sizes.sessions} sessions: median later turn TTFT (s)",
            lambda f: f["sessions"]["later_median"],
            False,
        ),
    ]
    for n in sizes.streams:
        out.append((f"{n} concurrent streams (tok/s)", lambda f, n=n: f["aggregate"][str(n)], True))
    out += [
        (
            "CPU in the 5 s after a hang-up (s)",
            lambda f: f["hangup_cpu"]["cpu_seconds_after_hangup"],
            False,
        ),
        ("/health latency under load, p99 (ms)", lambda f: f["health"]["p99_ms"], False),
        ("longest token gap while a prompt prefills (s)", lambda f: f["gap"]["max_gap_s"], False),
    ]
    return out


def fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def table(results: dict[str, Any], sizes: Sizes) -> str:
    lines = [
        "| workload | mlx_lm.server | mlxtrio | mlxtrio's advantage |",
        "|---|---|---|---|",
        f"| raw mlx-lm `stream_generate`, no server (tok/s) | {fmt(results['raw_decode_tokens_per_second'])} | | |",
    ]
    peer, ours = results.get("mlx_lm"), results.get("mlxtrio")
    for label, value, higher in rows(sizes):
        a = value(peer) if peer else None
        b = value(ours) if ours else None
        edge = "—"
        if a and b:
            edge = f"{(b / a if higher else a / b):.2f}x"
        elif a == 0 and b == 0:
            edge = "equal"
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {edge} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], sizes: Sizes, name: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in SERVERS if k in results]
    colors = {"mlx_lm": "tab:gray", "mlxtrio": "tab:blue"}
    labels = {"mlx_lm": "mlx_lm.server", "mlxtrio": "mlxtrio"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    fig.suptitle(f"mlx_lm.server vs mlxtrio, {name} model (lower is better unless marked)")

    ax = axes[0][0]
    values = [results["raw_decode_tokens_per_second"]] + [
        results[k]["decode"]["tokens_per_second"] for k in kinds
    ]
    ax.bar(
        ["raw mlx-lm"] + [labels[k] for k in kinds],
        values,
        color=["tab:green"] + [colors[k] for k in kinds],
    )
    ax.set_title("decode, 1 stream (tok/s, higher is better)")

    ax = axes[0][1]
    for k in kinds:
        ax.plot(
            sizes.contexts,
            [results[k]["ttft"][str(n)] for n in sizes.contexts],
            "o-",
            color=colors[k],
            label=labels[k],
        )
    ax.set_title("cold TTFT (s) by prompt tokens")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend()

    ax = axes[0][2]
    for k in kinds:
        turns = results[k]["agent_loop"]["turns"]
        ax.plot(range(1, len(turns) + 1), turns, "o-", color=colors[k], label=labels[k])
    ax.set_title("agent loop: TTFT per turn (s)")
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.legend()

    ax = axes[1][0]
    for k in kinds:
        ax.plot(
            sizes.streams,
            [results[k]["aggregate"][str(n)] for n in sizes.streams],
            "o-",
            color=colors[k],
            label=labels[k],
        )
    ax.set_title("aggregate tok/s by concurrent streams (higher is better)")
    ax.set_xticks(list(sizes.streams))
    ax.legend()

    ax = axes[1][1]
    later = [results[k]["sessions"]["later_median"] for k in kinds]
    ax.bar([labels[k] for k in kinds], later, color=[colors[k] for k in kinds])
    ax.set_title(f"{sizes.sessions} interleaved sessions: median later-turn TTFT (s)")

    ax = axes[1][2]
    metrics = [
        ("CPU s after\nhang-up", lambda f: f["hangup_cpu"]["cpu_seconds_after_hangup"] or 0.0),
        ("/health p99\n(s x 10)", lambda f: f["health"]["p99_ms"] / 100),
        ("max gap during\nprefill (s)", lambda f: f["gap"]["max_gap_s"]),
    ]
    width = 0.8 / max(1, len(kinds))
    for i, k in enumerate(kinds):
        xs = [j + i * width for j in range(len(metrics))]
        ax.bar(xs, [get(results[k]) for _, get in metrics], width, color=colors[k], label=labels[k])
    ax.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(metrics))])
    ax.set_xticklabels([m for m, _ in metrics])
    ax.set_title("waste and responsiveness")
    ax.legend()

    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    for ax in axes.flat:  # plain numbers (1, 2, 5, 10, …) on the log axes too
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                axis.set_minor_formatter(NullFormatter())
                axis.set_major_formatter(ScalarFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def machine() -> str:
    import mlx.core as mx

    from mlxtrio.engine.precision import fast_cpu_blas

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{platform.system()} {platform.machine()} ({cpu}), {os.cpu_count()} cores, "
        f"{memory:.0f} GiB; MLX {mx.__version__} on {mx.default_device()}, BLAS "
        f"{fast_cpu_blas() or 'MLX bundled reference'}; Python {platform.python_version()}"
    )


def write(name: str, results: dict[str, Any], sizes: Sizes, out: Path, smoke: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"side_by_side-{name}{'-smoke' if smoke else ''}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, sizes, name, stem.with_suffix(".png"))
    text = table(results, sizes)
    stem.with_suffix(".md").write_text(
        f"# mlx_lm.server vs mlxtrio: {name} model\n\n"
        f"`python benchmarks/side_by_side.py --models {name}`{' --smoke' if smoke else ''}, "
        f"{time.strftime('%Y-%m-%d')}. Machine: {machine()}. Both servers with their "
        "defaults, one at a time, through `/v1/chat/completions`, on a float32 copy of the "
        "model (the same compute type and BLAS for both). Raw figures: "
        f"`{stem.with_suffix('.json').name}`.\n\n{text}\n\n![plots]({stem.with_suffix('.png').name})\n"
    )
    print(f"\n## {name}\n\n{text}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded,small")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the tables and plots from --out's JSON"
    )
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else Sizes()
    servers = [s for s in args.servers.split(",") if s]
    for name in args.models.split(","):
        if args.replot:
            stem = args.out / f"side_by_side-{name}{'-smoke' if args.smoke else ''}"
            results = json.loads(stem.with_suffix(".json").read_text())
        else:
            results = run_model(name, servers, sizes)
        write(name, results, sizes, args.out, args.smoke)


if __name__ == "__main__":
    main()
