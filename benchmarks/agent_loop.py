"""Agent-loop benchmarks: prefix cache on, off, and mlx_lm.server, in four scenarios.

    python benchmarks/agent_loop.py [--model PATH] [--turns 10] [--openblas]
    python benchmarks/agent_loop.py --sessions 12 --turns 4 --servers mlxtrio,mlx_lm
    python benchmarks/agent_loop.py --scenario shared [--sessions 12] [--turns 2]
        [--system-tokens 12000] [--tail-tokens 300]
    python benchmarks/agent_loop.py --scenario restart [--system-tokens 12000]
    python benchmarks/agent_loop.py --scenario retry [--retry-tokens 5000] [--hangup-after 4]

Every scenario starts each server in ``--servers`` in turn (one process at a
time, on a fresh temporary data dir), warms it up with a short request (model
load, compilation), and measures TTFT on the client as the wall time of a
request for *one* output token (prefill, the first token, the end of the
response). The first visible delta is not a fair mark: the tiny model's first
tokens are often a tool call, which a server holds back until it parses (or,
cut at a few tokens, never shows), and whitespace, which servers trim
differently. mlxtrio is asked through ``/v1/responses``, mlx_lm.server through
``/v1/chat/completions``, with the same system prompt, tools and messages.
Cached prompt tokens come from mlxtrio's ``X-Cached-Tokens`` header, and from
``usage.prompt_tokens_details.cached_tokens`` for mlx_lm.server. Long texts are
fixed, varied sentences sized with the model's tokenizer. Each scenario prints
a Markdown table and its ratios; ``--json PATH`` writes the raw figures.
(``--system-tokens`` / ``--retry-tokens`` size the system text; the tools and
the chat template add ~400 tokens, shown as the server's prompt tokens.)

``loop`` (the default): a 10-turn agent conversation with a ~2k-token system
prompt and tools, resent in full every turn like Claude Code and Codex do,
growing by a user message and an assistant reply per turn (fixed texts, so all
servers see the same conversation). Goal ratios:

* warm-turn TTFT with the cache / without it   (goal <= 0.2)
* warm-turn TTFT with the cache / mlx_lm.server (goal <= 0.5)

``--sessions N`` runs N such conversations (same system prompt and tools, each on
its own task) interleaved turn by turn, like a main agent with sub-agents or a
few agent windows on one server: a cache only helps if it keeps every one of
them warm until its next turn. (The uncached server takes ~15 s a turn.)

``shared``: ``--sessions`` (12) conversations share one large system prompt
(``--system-tokens``, ~12k) and each starts with its own ~300-token tail
(``--tail-tokens``), ``--turns`` (2) interleaved turns each. Reports the TTFT of
session 1's cold first turn, the median first turn of the other sessions (the
shared prefix only), the median later turn, the bytes the cache holds after
session 1's first turn and after all (mlxtrio's ``mlxtrio_prefix_cache_bytes``;
mlx_lm.server has no metric: its RSS growth), the server's RSS growth
(``/proc/<pid>/status`` VmRSS; not on macOS) against the counted bytes, and
the bytes held per session relative to one session (1.0 = no sharing at all).

``restart``: the cold first turn of a ``--system-tokens`` conversation on a fresh
data dir, the same again in the same process, then the server is stopped
(SIGTERM, waiting for it to exit), started on the same data dir, and asked the
same conversation: TTFT and cached tokens after the restart vs cold (a disk tier
keeps them; mlx_lm.server has none, so 0). Then it is restarted once more and
asked a "second project": the same system prompt, another first user message.

``retry``: the hang-up-and-retry that Claude Code produces. A streamed request
with a ``--retry-tokens`` (~5k) prompt is sent over a raw socket, which is
closed after ``--hangup-after`` seconds (while it is still prefilling), and the
same request is sent again at once without streaming (one output token): its
TTFT and cached tokens against a cold run of a prompt of the same length (that
differs from its first line on, so it leaves nothing to reuse).

``--disk-bytes N`` sets ``MLXTRIO_PREFIX_CACHE_DISK_BYTES`` for mlxtrio (the
uncached server always runs with 0). ``--openblas`` preloads Debian's OpenBLAS
for every server (Linux), so all sides multiply through the same BLAS.
(mlxtrio loads it by itself when it is installed; ``mlx_lm.server`` does not.
``MLXTRIO_SYSTEM_BLAS=0`` in the environment keeps mlxtrio on the wheel's
reference BLAS too.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _servers import wait_ready  # noqa: E402

from mlxtrio.settings import EMBEDDED_MODEL_PATH  # noqa: E402

OPENBLAS = os.environ.get(
    "OPENBLAS", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
)  # or where it was extracted
SERVERS = {"mlxtrio": "mlxtrio", "mlxtrio-nocache": "no cache", "mlx_lm": "mlx_lm.server"}
SCENARIOS = ("loop", "shared", "restart", "retry")
DEFAULTS = {"loop": {"sessions": 1, "turns": 10}, "shared": {"sessions": 12, "turns": 2}}
HANGUP_MAX_TOKENS = 256  # the abandoned stream asks for a real answer, like an agent
STOP_TIMEOUT = 60.0
SETTLE = 0.3  # seconds before reading memory figures after a request

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
AGENT_HEADER = "You are a coding agent working in a user's repository. Project handbook:"
SUBJECTS = ("parser", "scheduler", "cache layer", "HTTP router", "tokenizer", "storage engine")
VERBS = ("validates", "serializes", "retries", "logs", "streams", "batches", "rejects")
OBJECTS = (
    "incoming requests",
    "config files",
    "user sessions",
    "database rows",
    "audit events",
    "large uploads",
    "stale locks",
    "cron jobs",
    "feature flags",
    "error reports",
    "build artifacts",
)
CLAUSES = (
    "before anything is written to disk",
    "whenever the retry budget allows it",
    "and records the outcome in the changelog",
    "unless the caller asked for a dry run",
    "so keep its tests next to the module",
)


# --- prompts ---------------------------------------------------------------


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


def with_tail(per_turn: list[list[dict]], tail: str) -> list[list[dict]]:
    """``per_turn`` with ``tail`` put before the first user message of every turn."""
    first = {"role": "user", "content": tail + "\n" + per_turn[0][0]["content"]}
    return [[first, *history[1:]] for history in per_turn]


def sentence(i: int) -> str:
    """Fixed, varied filler: the i-th note of a made-up project handbook."""
    return f"Note {i}: the {SUBJECTS[i % 6]} {VERBS[i % 7]} {OBJECTS[i % 11]} {CLAUSES[i % 5]}."


def load_tokenizer(model: str) -> Any:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def sized_text(tokenizer: Any, tokens: int, header: str, start: int = 0) -> str:
    """``header`` then handbook notes from ``start`` on, about ``tokens`` tokens long."""
    lines, count, i = [header], count_tokens(tokenizer, header + "\n"), start
    while count < tokens:
        lines.append(sentence(i))
        count += count_tokens(tokenizer, lines[-1] + "\n")
        i += 1
    return "\n".join(lines)


def build_texts(args: argparse.Namespace) -> dict[str, Any]:
    """The prompts of ``args.scenario`` (and, in ``tokens``, their sizes)."""
    if args.scenario == "loop":
        histories = [conversation(args.turns, s) for s in range(args.sessions)]
        return {"system": system_prompt(), "histories": histories, "tokens": {}}
    tok = load_tokenizer(args.model)
    if args.scenario == "retry":
        system = sized_text(tok, args.retry_tokens, "[retry] " + AGENT_HEADER)
        cold = sized_text(tok, args.retry_tokens, "[cold] " + AGENT_HEADER)
        tokens = {"system": count_tokens(tok, system), "cold_system": count_tokens(tok, cold)}
        return {
            "system": system,
            "cold_system": cold,
            "first": conversation(1)[0],
            "tokens": tokens,
        }
    system = sized_text(tok, args.system_tokens, AGENT_HEADER)
    tokens = {"system": count_tokens(tok, system)}
    if args.scenario == "restart":
        return {"system": system, "first": conversation(1)[0], "other": conversation(1, 1)[0]} | {
            "tokens": tokens
        }
    tails = [
        sized_text(tok, args.tail_tokens, f"Context of task {s + 1}:", 100_000 + 1000 * s)
        for s in range(args.sessions)
    ]
    histories = [with_tail(conversation(args.turns, s), tails[s]) for s in range(args.sessions)]
    tokens["tails"] = [count_tokens(tok, t) for t in tails]
    return {"system": system, "histories": histories, "tokens": tokens}


# --- requests --------------------------------------------------------------


@dataclass
class Reply:
    seconds: float
    cached: int | None  # X-Cached-Tokens, else the usage's cached prompt tokens
    state: str | None  # X-Session-Cache
    prompt_tokens: int | None


def request_body(
    kind: str, model: str, system: str, history: list[dict], max_tokens: int, stream: bool
) -> tuple[str, dict]:
    """The path and body of one turn: Responses for mlxtrio, Chat Completions for mlx_lm."""
    if kind != "mlx_lm":
        body = {
            "model": model,
            "instructions": system,
            "input": history,
            "tools": TOOLS,
            "stream": stream,
            "max_output_tokens": max_tokens,
            "store": False,
        }
        return "/v1/responses", body
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
    ]
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, *history],
        "tools": tools,
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body


def _usage_of(event: dict) -> dict | None:
    """The usage of a Responses event or a Chat Completions chunk / response."""
    if isinstance(event.get("usage"), dict):
        return event["usage"]
    response = event.get("response")
    return response.get("usage") if isinstance(response, dict) else None


def _stream_usage(lines: Iterable[str]) -> dict:
    """Read an SSE stream to its end; the last usage it carried."""
    usage: dict = {}
    for line in lines:
        if line.startswith("data:") and '"usage"' in line:
            try:
                usage = _usage_of(json.loads(line[5:])) or usage
            except json.JSONDecodeError:
                pass
    return usage


def _reply(seconds: float, headers: httpx.Headers, usage: dict) -> Reply:
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    header = headers.get("x-cached-tokens")
    cached = int(header) if header is not None else details.get("cached_tokens")
    prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
    return Reply(seconds, cached, headers.get("x-session-cache"), prompt)


def request(
    server: Server, system: str, history: list[dict], max_tokens: int, stream: bool = True
) -> Reply:
    """One turn; ``seconds`` runs from sending it to the end of the response."""
    path, body = request_body(server.kind, server.model, system, history, max_tokens, stream)
    started = time.perf_counter()
    with httpx.Client(timeout=1800) as client:
        if stream:
            with client.stream("POST", server.url + path, json=body) as r:
                r.raise_for_status()
                usage = _stream_usage(r.iter_lines())
        else:
            r = client.post(server.url + path, json=body)
            r.raise_for_status()
            usage = r.json().get("usage") or {}
    return _reply(time.perf_counter() - started, r.headers, usage)


def hang_up(server: Server, system: str, history: list[dict], after: float) -> dict:
    """Stream a turn over a raw socket and close it after ``after`` seconds."""
    path, body = request_body(server.kind, server.model, system, history, HANGUP_MAX_TOKENS, True)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + data)
        time.sleep(after)
        received = _drain(sock)
    done = any(m in received for m in (b"response.completed", b"response.incomplete", b"[DONE]"))
    cached = re.search(rb"(?im)^x-cached-tokens:\s*(\d+)", received)
    return {
        "after": after,
        "finished_before_hangup": done,
        "cached": int(cached.group(1)) if cached else None,
    }


def _drain(sock: socket.socket) -> bytes:
    """What has arrived on ``sock`` so far, without waiting for more."""
    sock.setblocking(False)
    chunks = []
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except (BlockingIOError, ConnectionError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


# --- server processes ------------------------------------------------------


@dataclass
class Server:
    kind: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    data_dir: Path
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.cmd[self.cmd.index("--model") + 1] if self.kind == "mlx_lm" else "bench"

    @property
    def ready_path(self) -> str:
        return "/v1/models" if self.kind == "mlx_lm" else "/health"


def server_command(kind: str, args: argparse.Namespace, port: int, data_dir: Path) -> list[str]:
    if kind == "mlx_lm":
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", args.model]
        cmd += ["--port", str(port), "--host", "127.0.0.1"]
        if args.mlx_lm_prompt_cache_size is not None:
            cmd += ["--prompt-cache-size", str(args.mlx_lm_prompt_cache_size)]
        return cmd
    cmd = [sys.executable, "-m", "mlxtrio.cli", "serve", "--port", str(port)]
    cmd += ["--model", args.model, "--model-name", "bench", "--log-level", "warning"]
    cmd += ["--data-dir", str(data_dir)]
    return cmd + ["--prefix-cache-bytes", "0" if kind == "mlxtrio-nocache" else "-1"]


def server_env(kind: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, str]:
    env = dict(env)
    if kind == "mlxtrio-nocache":
        env["MLXTRIO_PREFIX_CACHE_DISK_BYTES"] = "0"
    elif kind == "mlxtrio" and args.disk_bytes is not None:
        env["MLXTRIO_PREFIX_CACHE_DISK_BYTES"] = str(args.disk_bytes)
    return env


def start(server: Server) -> float:
    """Start the process and wait until it answers; seconds that took."""
    started = time.perf_counter()
    with server.log.open("ab") as log:
        server.proc = subprocess.Popen(
            server.cmd, env=server.env, stdout=subprocess.DEVNULL, stderr=log
        )
    wait_ready(server.url, server.ready_path, server.proc)
    return time.perf_counter() - started


def warm_up(server: Server) -> None:
    """Load and compile with a short prompt that shares no prefix with the tests."""
    request(server, "warm-up " + system_prompt()[:200], [{"role": "user", "content": "hi"}], 2)


def stop(server: Server) -> float:
    """SIGTERM, then wait for the process to exit; seconds that took."""
    proc = server.proc
    if proc is None or proc.poll() is not None:
        return 0.0
    started = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.perf_counter() - started


@contextmanager
def running(kind: str, args: argparse.Namespace, port: int, env: dict) -> Iterator[Server]:
    """A warmed-up server of ``kind`` on a fresh temporary data dir."""
    with tempfile.TemporaryDirectory(prefix=f"agent-loop-{kind}-") as tmp:
        data_dir = Path(tmp) / "data"
        cmd = server_command(kind, args, port, data_dir)
        server = Server(kind, port, cmd, server_env(kind, env, args), data_dir, Path(tmp) / "log")
        try:
            start(server)
            warm_up(server)
            yield server
        except Exception:
            print(f"--- {kind} server log (tail) ---", file=sys.stderr)
            print(_tail(server.log), file=sys.stderr)
            raise
        finally:
            stop(server)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- memory figures --------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` from /proc (None where there is no /proc: macOS)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.M)
    return int(found.group(1)) * 1024 if found else None


def metric(server: Server, name: str) -> float | None:
    """The sum of ``name`` over its labels in mlxtrio's /metrics (None if absent)."""
    if server.kind == "mlx_lm":
        return None
    text = httpx.get(server.url + "/metrics", timeout=30).text
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    values = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
    return sum(values) if values else None


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def memory_point(server: Server) -> dict[str, float | None]:
    """RSS, counted cache bytes (memory and disk) and kv-cache dir size now."""
    time.sleep(SETTLE)
    assert server.proc is not None
    return {
        "rss": rss_bytes(server.proc.pid),
        "counted": metric(server, "mlxtrio_prefix_cache_bytes"),
        "active": metric(server, "mlxtrio_mlx_active_bytes"),
        "disk": metric(server, "mlxtrio_prefix_cache_disk_bytes"),
        "kv_dir": dir_bytes(server.data_dir / "kv-cache"),
    }


# --- scenarios -------------------------------------------------------------


def run_loop(server: Server, args: argparse.Namespace, texts: dict) -> list[float]:
    """Per-turn TTFT, averaged over the sessions (turn t of every session, then t + 1)."""
    histories = texts["histories"]
    return [
        statistics.mean(
            request(server, texts["system"], histories[s][t], args.max_tokens).seconds
            for s in range(args.sessions)
        )
        for t in range(args.turns)
    ]


def run_shared(server: Server, args: argparse.Namespace, texts: dict) -> dict:
    """Interleaved turns of sessions that share the system prompt; memory figures."""
    replies: list[list[dict]] = [[] for _ in range(args.sessions)]
    memory = {"baseline": memory_point(server)}
    for t in range(args.turns):
        for s in range(args.sessions):
            reply = request(server, texts["system"], texts["histories"][s][t], args.max_tokens)
            replies[s].append(asdict(reply))
            if (s, t) == (0, 0):
                memory["after_one"] = memory_point(server)
    memory["after_all"] = memory_point(server)
    return {"replies": replies, "memory": memory}


def run_restart(server: Server, args: argparse.Namespace, texts: dict) -> dict:
    """Cold, warm, after a restart, and a second project after another restart."""
    system, first = texts["system"], texts["first"]
    out: dict[str, Any] = {"cold": asdict(request(server, system, first, args.max_tokens))}
    out["warm"] = asdict(request(server, system, first, args.max_tokens))
    out["before_stop"] = memory_point(server)
    out["stop_seconds"] = stop(server)
    out["kv_dir_after_stop"] = dir_bytes(server.data_dir / "kv-cache")
    out["start_seconds"] = start(server)
    warm_up(server)
    out["after_restart"] = asdict(request(server, system, first, args.max_tokens))
    out["after_restart_memory"] = memory_point(server)
    stop(server)
    start(server)
    warm_up(server)
    out["second_project"] = asdict(request(server, system, texts["other"], args.max_tokens))
    return out


def run_retry(server: Server, args: argparse.Namespace, texts: dict) -> dict:
    """A cold run, then a stream hung up mid-prefill and the same request at once."""
    first = texts["first"]
    cold = request(server, texts["cold_system"], first, 1, stream=False)
    hung = hang_up(server, texts["system"], first, args.hangup_after)
    retry = request(server, texts["system"], first, 1, stream=False)
    return {"cold": asdict(cold), "hung_up": hung, "retry": asdict(retry)}


RUNNERS: dict[str, Callable[[Server, argparse.Namespace, dict], Any]] = {
    "loop": run_loop,
    "shared": run_shared,
    "restart": run_restart,
    "retry": run_retry,
}


# --- reports ---------------------------------------------------------------


def fmt(value: Any, unit: str = "") -> str:
    """A table cell: seconds, bytes (MiB), ratios, counts; n/a for None."""
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "B":
        return f"{value / (1 << 20):.1f} MiB"
    if unit == "x":
        return f"{value:.3f}"
    return str(value)


def table(header: str, rows: list[tuple[str, dict[str, str]]], kinds: Iterable[str]) -> None:
    """A Markdown table: one row per figure, one column per server."""
    kinds = list(kinds)
    print(f"| {header} | " + " | ".join(SERVERS[k] for k in kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(cells.get(k, "n/a") for k in kinds) + " |")


def per_server(results: dict[str, Any], get: Callable[[Any], str]) -> dict[str, str]:
    """One table row's cells: ``get`` of each server's result."""
    return {kind: get(result) for kind, result in results.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def growth(memory: dict, point: str, key: str) -> float | None:
    now, base = memory[point][key], memory["baseline"][key]
    return now - base if now is not None and base is not None else None


def report_loop(results: dict[str, list[float]], args: argparse.Namespace, texts: dict) -> None:
    print(
        f"model: {args.model}   turns: {args.turns}   sessions: {args.sessions}   "
        f"openblas: {args.openblas}   mlx_lm prompt cache size: "
        f"{args.mlx_lm_prompt_cache_size or 'default'}\n"
    )
    rows = [
        (str(t + 1), {k: fmt(v[t], "s") for k, v in results.items()}) for t in range(args.turns)
    ]
    warm = {k: statistics.mean(v[1:]) if len(v) > 1 else None for k, v in results.items()}
    rows.append((f"warm turns (2..{args.turns}) mean", {k: fmt(v, "s") for k, v in warm.items()}))
    table("turn (TTFT)", rows, results)
    if "mlxtrio" in warm and "mlxtrio-nocache" in warm:
        value = ratio(warm["mlxtrio"], warm["mlxtrio-nocache"])
        print(f"\nratio cached / no cache:      {fmt(value, 'x')}  (goal <= 0.2)")
    if "mlxtrio" in warm and "mlx_lm" in warm:
        value = ratio(warm["mlxtrio"], warm["mlx_lm"])
        print(f"ratio cached / mlx_lm.server: {fmt(value, 'x')}  (goal <= 0.5)")


def shared_summary(result: dict, kind: str) -> dict[str, Any]:
    """The reported figures of one server's ``shared`` run."""
    replies, memory = result["replies"], result["memory"]
    held = "counted" if kind != "mlx_lm" else "rss"
    one, everything = growth(memory, "after_one", held), growth(memory, "after_all", held)
    rss_all = growth(memory, "after_all", "rss")
    return {
        "prompt_tokens": replies[0][0]["prompt_tokens"],
        "cold": replies[0][0]["seconds"],
        "cold_cached": replies[0][0]["cached"],
        "first": median(r[0]["seconds"] for r in replies[1:]),
        "first_cached": median(r[0]["cached"] for r in replies[1:]),
        "later": median(x["seconds"] for r in replies for x in r[1:]),
        "later_cached": median(x["cached"] for r in replies for x in r[1:]),
        "held_one": one,
        "held_all": everything,
        "rss_one": growth(memory, "after_one", "rss"),
        "rss_all": rss_all,
        "counted_all": memory["after_all"]["counted"],
        "disk_all": memory["after_all"]["disk"],
        "kv_dir_all": memory["after_all"]["kv_dir"],
        "rss_per_counted": ratio(rss_all, everything) if kind != "mlx_lm" else None,
        "active_all": growth(memory, "after_all", "active") if kind != "mlx_lm" else None,
        "active_per_counted": (
            ratio(growth(memory, "after_all", "active"), everything) if kind != "mlx_lm" else None
        ),
        "per_session": ratio(everything, one * len(replies)) if one else None,
    }


SHARED_ROWS = [
    ("prompt tokens, session 1 turn 1 (server)", "prompt_tokens", ""),
    ("TTFT session 1, turn 1 (cold)", "cold", "s"),
    ("cached tokens, session 1 turn 1", "cold_cached", ""),
    ("median TTFT, first turn of sessions 2..N", "first", "s"),
    ("median cached tokens, first turns 2..N", "first_cached", ""),
    ("median TTFT, later turns", "later", "s"),
    ("median cached tokens, later turns", "later_cached", ""),
    ("cache bytes held after session 1 turn 1 (mlx_lm: RSS growth)", "held_one", "B"),
    ("cache bytes held after all (mlx_lm: RSS growth)", "held_all", "B"),
    ("counted cache bytes after all (metric)", "counted_all", "B"),
    ("counted disk bytes after all (metric)", "disk_all", "B"),
    ("kv-cache dir after all", "kv_dir_all", "B"),
    ("RSS growth after session 1 turn 1", "rss_one", "B"),
    ("RSS growth after all", "rss_all", "B"),
    ("RSS growth / counted bytes growth", "rss_per_counted", "x"),
    ("MLX active memory growth after all (idle)", "active_all", "B"),
    ("MLX active memory growth / counted bytes growth", "active_per_counted", "x"),
    ("bytes per session / bytes of one session", "per_session", "x"),
]


def report_shared(results: dict[str, dict], args: argparse.Namespace, texts: dict) -> None:
    tokens = texts["tokens"]
    print(
        f"model: {args.model}   sessions: {args.sessions}   turns: {args.turns}   "
        f"system: {tokens['system']} tokens   tails: {median(tokens['tails'])} tokens (median)\n"
    )
    summaries = {k: shared_summary(v, k) for k, v in results.items()}
    rows = [
        (name, {k: fmt(s[key], unit) for k, s in summaries.items()})
        for name, key, unit in SHARED_ROWS
    ]
    table("shared system prompt", rows, results)
    print()
    for kind, s in summaries.items():
        print(
            f"{SERVERS[kind]}: later / cold TTFT {fmt(ratio(s['later'], s['cold']), 'x')}, "
            f"first (2..N) / cold {fmt(ratio(s['first'], s['cold']), 'x')}, "
            f"bytes per session / one session {fmt(s['per_session'], 'x')} "
            f"(1.0 = nothing shared; 1/N = all shared)"
        )
    if rss_bytes(os.getpid()) is None:
        print("RSS: n/a (no /proc on this platform, e.g. macOS)")


RESTART_ROWS = [
    ("cold first turn", "cold"),
    ("same turn again, same process", "warm"),
    ("same turn, first request after restart", "after_restart"),
    ("second project (same system, other message), after restart", "second_project"),
]


def reply_rows(results: dict[str, dict], name: str, key: str) -> list[tuple[str, dict[str, str]]]:
    """TTFT, cached tokens and X-Session-Cache of the reply ``key`` of every server."""
    return [
        (f"TTFT, {name}", per_server(results, lambda v: fmt(v[key]["seconds"], "s"))),
        (f"cached tokens, {name}", per_server(results, lambda v: fmt(v[key]["cached"]))),
        (f"X-Session-Cache, {name}", per_server(results, lambda v: fmt(v[key]["state"]))),
    ]


def report_restart(results: dict[str, dict], args: argparse.Namespace, texts: dict) -> None:
    print(f"model: {args.model}   system: {texts['tokens']['system']} tokens\n")
    rows = [row for name, key in RESTART_ROWS for row in reply_rows(results, name, key)]
    rows += [
        ("prompt tokens (server)", per_server(results, lambda v: fmt(v["cold"]["prompt_tokens"]))),
        (
            "counted disk bytes before stop",
            per_server(results, lambda v: fmt(v["before_stop"]["disk"], "B")),
        ),
        (
            "kv-cache dir after stop",
            per_server(results, lambda v: fmt(v["kv_dir_after_stop"], "B")),
        ),
        ("seconds to stop", per_server(results, lambda v: fmt(v["stop_seconds"], "s"))),
        (
            "seconds to start (until ready)",
            per_server(results, lambda v: fmt(v["start_seconds"], "s")),
        ),
    ]
    table("restart", rows, results)
    print()
    for kind, v in results.items():
        cold = v["cold"]["seconds"]
        print(
            f"{SERVERS[kind]}: after restart / cold TTFT "
            f"{fmt(ratio(v['after_restart']['seconds'], cold), 'x')}, second project / cold "
            f"{fmt(ratio(v['second_project']['seconds'], cold), 'x')}, warm / cold "
            f"{fmt(ratio(v['warm']['seconds'], cold), 'x')}"
        )


def report_retry(results: dict[str, dict], args: argparse.Namespace, texts: dict) -> None:
    tokens = texts["tokens"]
    print(
        f"model: {args.model}   prompt: {tokens['system']} tokens (cold variant "
        f"{tokens['cold_system']})   hang-up after {args.hangup_after} s\n"
    )

    def cells(get: Callable[[dict], str]) -> dict[str, str]:
        return per_server(results, get)

    rows = [
        (
            "TTFT, cold run (other prompt, same size)",
            cells(lambda v: fmt(v["cold"]["seconds"], "s")),
        ),
        ("cached tokens, cold run", cells(lambda v: fmt(v["cold"]["cached"]))),
        ("prompt tokens (server)", cells(lambda v: fmt(v["retry"]["prompt_tokens"]))),
        (
            "hung-up stream finished before the hang-up",
            cells(lambda v: fmt(v["hung_up"]["finished_before_hangup"])),
        ),
        ("cached tokens, hung-up stream", cells(lambda v: fmt(v["hung_up"]["cached"]))),
        ("TTFT, retry (from its send)", cells(lambda v: fmt(v["retry"]["seconds"], "s"))),
        ("cached tokens, retry", cells(lambda v: fmt(v["retry"]["cached"]))),
        ("X-Session-Cache, retry", cells(lambda v: fmt(v["retry"]["state"]))),
        (
            "hang-up + retry (from the first send)",
            cells(lambda v: fmt(v["hung_up"]["after"] + v["retry"]["seconds"], "s")),
        ),
    ]
    table("hang-up and retry", rows, results)
    print()
    for kind, v in results.items():
        cold, retry = v["cold"]["seconds"], v["retry"]["seconds"]
        print(
            f"{SERVERS[kind]}: retry / cold TTFT {fmt(ratio(retry, cold), 'x')}, "
            f"(hang-up + retry) / cold {fmt(ratio(v['hung_up']['after'] + retry, cold), 'x')}"
        )


REPORTS: dict[str, Callable[[dict, argparse.Namespace, dict], None]] = {
    "loop": report_loop,
    "shared": report_shared,
    "restart": report_restart,
    "retry": report_retry,
}


# --- main ------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=SCENARIOS, default="loop")
    parser.add_argument("--model", default=str(EMBEDDED_MODEL_PATH))
    parser.add_argument("--turns", type=int, help="turns per session (loop: 10, shared: 2)")
    parser.add_argument(
        "--sessions", type=int, help="interleaved conversations (loop: 1, shared: 12)"
    )
    parser.add_argument("--max-tokens", type=int, default=1, help="output tokens per turn")
    parser.add_argument(
        "--system-tokens", type=int, default=12000, help="shared, restart: system prompt size"
    )
    parser.add_argument(
        "--tail-tokens", type=int, default=300, help="shared: each session's own tail"
    )
    parser.add_argument("--retry-tokens", type=int, default=5000, help="retry: prompt size")
    parser.add_argument(
        "--hangup-after", type=float, default=4.0, help="retry: seconds before hanging up"
    )
    parser.add_argument("--disk-bytes", type=int, help="mlxtrio's MLXTRIO_PREFIX_CACHE_DISK_BYTES")
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help=f"comma-separated subset of {list(SERVERS)}"
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
    parser.add_argument("--json", type=Path, help="write the raw figures to this file")
    args = parser.parse_args()
    for name, value in DEFAULTS.get(args.scenario, {}).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main() -> None:
    args = parse_args()
    env = {**os.environ}
    if args.openblas:
        if not Path(OPENBLAS).exists():
            sys.exit(f"{OPENBLAS} not found (apt-get install libopenblas0-pthread)")
        env["LD_PRELOAD"] = OPENBLAS
    kinds = [k for k in SERVERS if k in args.servers.split(",")]
    texts = build_texts(args)
    results: dict[str, Any] = {}
    for i, kind in enumerate(kinds):
        with running(kind, args, args.port + i, env) as server:
            results[kind] = RUNNERS[args.scenario](server, args, texts)
    REPORTS[args.scenario](results, args, texts)
    if args.json:
        raw = {"scenario": args.scenario, "args": vars(args), "tokens": texts["tokens"]}
        args.json.write_text(json.dumps(raw | {"results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
