"""Responsiveness under load (issue 19): loop latency, stalls, hang-ups, prefill speed.

    python benchmarks/responsiveness.py [--tree PATH] [--json PATH] [--quick]
    python benchmarks/responsiveness.py --tree /work/before --json before.json
    python benchmarks/responsiveness.py --long 30000 --mid 8000 --shared 3000 --streams 8

Starts ``mlxtrio serve`` from ``--tree`` (default: this checkout) in a
subprocess, as ``PYTHONPATH=<tree> python -m mlxtrio.cli serve``, and drives it
over HTTP with plain ``/v1/responses`` streams, ``/health`` and nothing newer,
so the same script measures any tree (it prints which ``mlxtrio`` the server
imports). One server, one run, in this order:

1. **Prefill speed**, nothing else running: a ``--mid``-token and a
   ``--long``-token prompt, one output token each. Prefill tokens/s from the
   server's ``usage`` (prefilled tokens over its time to first token) and from
   the client (prefilled tokens over the request's wall time). The long prompt's
   KV stays in the prefix cache: the large entry the next steps need.
2. **Hang-up to idle**: a fresh ``--long``-token prompt; the client closes the
   socket ``--hangup-after`` seconds after the response headers (mid-prefill),
   then polls ``/health`` until the model has no active or queued sequence. Goal
   < 1 s. Also reports the engine steps run after the hang-up. A prefill chunk
   costs more the deeper it is in the prompt, so this is repeated at the end
   ("deep") with a prompt that resumes from the first ``--hangup-from`` tokens
   of the cached long entry (default: half of it): the engine is then that deep
   in the prompt when the client leaves.
3. **``/health`` latency** (sequential polls every ``--poll-interval`` s):
   idle; then with ``--streams`` streams decoding and the large entry cached;
   then while ``--lookups`` new requests sharing ``--shared`` tokens with that
   entry are looked up (and their short rest prefilled).
4. **Inter-token gaps** of the running streams, client side, from the arrival
   times of their SSE ``*.delta`` events: while nothing else runs (baseline),
   during those lookups, and while another request prefills ``--mid`` tokens
   (goal: p95 <= 0.5 s).

Every request but the shared-prefix lookups carries its own ``cache_salt``, so
its prefix lookup never walks the large entry: the lookup stall (3) and the
prefill stall (4) are measured apart. Prompts are numbered paragraphs of the
Python reference docs (``pydoc_data.topics``, from the standard library), cut to
size with the model's own tokenizer (``tokenizers`` in this process; no MLX).

The default model is a random-weights copy of the embedded model (same
architecture, context and cost per token, built once by
``tools/build_embedded_model.py --seed 0``): it never stops early, so the streams
decode for as long as the benchmark needs them. ``--model embedded`` uses the
tree's own ``mlxtrio/assets/tiny-chat`` (streams that end are restarted). The
client is threads with httpx, kept light (no JSON parsing per delta), but it
shares the machine's cores with the server: run it on an otherwise quiet machine
and compare runs made under similar load (the figures print the load average).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _servers import wait_ready  # noqa: E402

MODEL = "bench"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
QUICK = {
    "long": 3000,
    "mid": 1500,
    "shared": 800,
    "lookups": 1,
    "health_seconds": 3.0,
    "hangup_after": 1.0,
}


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Statistics


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, like numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values_s: list[float], *qs: float) -> dict[str, Any]:
    """Count, percentiles and max of durations given in seconds, in milliseconds."""
    out: dict[str, Any] = {"n": len(values_s)}
    for q in qs:
        v = pct(values_s, q)
        out[f"p{q:g}_ms"] = None if v is None else round(v * 1000, 1)
    out["max_ms"] = round(max(values_s) * 1000, 1) if values_s else None
    return out


# ---------------------------------------------------------------------------
# Prompts


class Prompts:
    """Varied text of a given token length, counted with the model's tokenizer."""

    def __init__(self, model_path: str) -> None:
        import pydoc_data.topics

        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        topics = pydoc_data.topics.topics
        self.paragraphs = [
            " ".join(p.split())
            for key in sorted(topics)
            for p in topics[key].split("\n\n")
            if len(p.strip()) > 80
        ]
        self._next = itertools.count(0, 97)  # where each text starts in the paragraphs

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, tag: str, tokens: int) -> str:
        """About ``tokens`` tokens of numbered paragraphs headed by ``tag``."""
        start = next(self._next)
        chars = tokens * 3  # ~1.8 characters a token with the embedded tokenizer
        while True:
            parts = [f"Reference notes {tag}."]
            length, i = 0, start
            while length < chars:
                para = f"{i - start + 1}. {self.paragraphs[i % len(self.paragraphs)]}"
                parts.append(para)
                length += len(para) + 2
                i += 1
            text = "\n\n".join(parts)
            if self.count(text) >= tokens:
                return self.cut(text, tokens)
            chars *= 2

    def cut(self, text: str, tokens: int) -> str:
        """The first ``tokens`` tokens of ``text``, as text."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        if len(enc.ids) <= tokens:
            return text
        return text[: enc.offsets[tokens - 1][1]]


# ---------------------------------------------------------------------------
# Server


@dataclass
class Server:
    tree: Path
    model_path: str
    port: int
    capacity: int
    max_output_tokens: int
    prefix_cache_bytes: int
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    imported: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        env.pop("MLXTRIO_LOG_LEVEL", None)
        return env

    def start(self) -> None:
        probe = subprocess.run(
            [sys.executable, "-c", "import mlxtrio; print(mlxtrio.__file__)"],
            env=self.env(),
            cwd=self.tree,
            capture_output=True,
            text=True,
            check=True,
        )
        self.imported = probe.stdout.strip()
        if not Path(self.imported).resolve().is_relative_to(self.tree.resolve()):
            sys.exit(f"the server would import {self.imported}, not the tree {self.tree}")
        log(f"server imports {self.imported}")
        cmd = [
            sys.executable,
            "-m",
            "mlxtrio.cli",
            "serve",
            "--model",
            self.model_path,
            "--model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--capacity",
            str(self.capacity),
            "--prefix-cache-bytes",
            str(self.prefix_cache_bytes),
            "--max-output-tokens",
            str(self.max_output_tokens),
            "--database-url",
            "none",
            "--log-level",
            "warning",
        ]
        fd, name = tempfile.mkstemp(prefix="mlxtrio-responsiveness-", suffix=".log")
        self.log_path = Path(name)
        self.proc = subprocess.Popen(
            cmd, env=self.env(), cwd=self.tree, stdout=fd, stderr=subprocess.STDOUT
        )
        os.close(fd)
        wait_ready(self.url, "/health", self.proc)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def engine_state(client: httpx.Client) -> dict[str, Any]:
    """The model's entry in ``/health`` (active_sequences, queued_requests, steps)."""
    return client.get("/health").json()["models"][0]


def cached_tokens_metric(client: httpx.Client) -> int | None:
    """``mlxtrio_prefix_cache_cached_tokens`` from ``/metrics`` (None if absent)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("mlxtrio_prefix_cache_cached_tokens"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def wait_idle(client: httpx.Client, timeout: float, interval: float = 0.02) -> dict[str, Any]:
    """Poll ``/health`` until the model runs and queues nothing; the last state."""
    deadline = time.perf_counter() + timeout
    while True:
        state = engine_state(client)
        if not state.get("active_sequences") and not state.get("queued_requests"):
            return state
        if time.perf_counter() > deadline:
            raise RuntimeError(f"engine not idle after {timeout} s: {state}")
        time.sleep(interval)


# ---------------------------------------------------------------------------
# Requests


def body(text: str, max_tokens: int, salt: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "input": text,
        "stream": True,
        "max_output_tokens": max_tokens,
        "store": False,
        "cache_salt": salt,
    }


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    sent: float = 0.0
    headers: float | None = None
    deltas: list[float] = field(default_factory=list)
    ended: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    status: str = ""


def run_stream(
    client: httpx.Client,
    payload: dict[str, Any],
    stop: threading.Event | None = None,
    s: Stream | None = None,
) -> Stream:
    """Send ``payload`` and read its SSE stream to the end (or until ``stop``),
    recording into ``s`` as it goes."""
    s = s or Stream()
    s.sent = time.perf_counter()
    try:
        with client.stream("POST", "/v1/responses", json=payload) as r:
            s.headers = time.perf_counter()
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
            terminal = False
            for line in r.iter_lines():
                if line.startswith("event: "):
                    if line.endswith(".delta"):
                        s.deltas.append(time.perf_counter())
                    elif line[7:] in TERMINAL:
                        terminal = True
                elif terminal and line.startswith("data: "):
                    response = json.loads(line[6:])["response"]
                    s.usage, s.status = response.get("usage") or {}, response["status"]
                    terminal = False
                if stop is not None and stop.is_set():
                    break
    finally:
        s.ended = time.perf_counter()
    return s


def gaps(streams: list[Stream], t0: float, t1: float) -> list[float]:
    """Inter-delta gaps of ``streams`` that overlap the window [t0, t1]."""
    out = []
    for s in streams:
        times = list(s.deltas)
        out += [b - a for a, b in itertools.pairwise(times) if b > t0 and a < t1]
    return out


class HealthPoller(threading.Thread):
    """Sequential ``GET /health`` every ``interval`` s: (sent, latency) pairs."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                sent = time.perf_counter()
                try:
                    client.get("/health").raise_for_status()
                    self.samples.append((sent, time.perf_counter() - sent))
                except httpx.HTTPError:
                    self.errors += 1
                self.stop.wait(self.interval)

    def latencies(self, t0: float, t1: float) -> list[float]:
        """Latencies of the polls that overlap [t0, t1]."""
        return [lat for sent, lat in list(self.samples) if sent <= t1 and sent + lat >= t0]


class Decoders:
    """``n`` threads, each keeping one long stream decoding until :meth:`stop`."""

    def __init__(self, url: str, n: int, max_tokens: int, run_id: str) -> None:
        self.url, self.n, self.max_tokens, self.run_id = url, n, max_tokens, run_id
        self.streams: list[Stream] = []
        self.errors: list[str] = []
        self.restarts = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as client:
            for k in itertools.count():
                if self._stop.is_set():
                    return
                if k:
                    self.restarts += 1
                text = f"Stream {i}, part {k}: write a very long story about a lighthouse keeper."
                payload = body(text, self.max_tokens, f"stream-{i}-{k}-{self.run_id}")
                s = Stream()
                self.streams.append(s)
                try:
                    run_stream(client, payload, self._stop, s)
                except (httpx.HTTPError, RuntimeError) as exc:
                    self.errors.append(f"stream {i}: {exc}")
                    self._stop.wait(0.5)

    def running(self, min_deltas: int) -> bool:
        live = [s for s in list(self.streams) if s.ended is None]
        return len(live) >= self.n and all(len(s.deltas) >= min_deltas for s in live)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


# ---------------------------------------------------------------------------
# Phases


def prefill(client: httpx.Client, text: str, salt: str) -> dict[str, Any]:
    """One 1-token request: its prompt, cache reuse and prefill speed."""
    s = run_stream(client, body(text, 1, salt))
    assert s.ended is not None
    wall = s.ended - s.sent
    usage = s.usage
    prompt = int(usage.get("input_tokens", 0))
    cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
    prefilled = prompt - cached
    ttft_ms = usage.get("time_to_first_token_ms")
    out = {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "wall_s": round(wall, 3),
        "server_ttft_s": None if ttft_ms is None else round(ttft_ms / 1000, 3),
        "server_prefill_tok_s": usage.get("prefill_tokens_per_second"),
        "client_prefill_tok_s": round(prefilled / wall, 1) if wall > 0 else None,
        "ttft_prefill_tok_s": round(prefilled / (ttft_ms / 1000), 1) if ttft_ms else None,
    }
    if out["server_prefill_tok_s"] is not None:
        out["server_prefill_tok_s"] = round(out["server_prefill_tok_s"], 1)
    return out


def hangup(server: Server, text: str, salt: str, after: float, timeout: float) -> dict[str, Any]:
    """Start a long prompt on a raw socket, close it ``after`` s past the response
    headers, and time until the engine is idle."""
    data = json.dumps(body(text, 16, salt)).encode()
    head = (
        f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        wait_idle(client, 60)
        reused = cached_tokens_metric(client)
        sock = socket.create_connection(("127.0.0.1", server.port))
        sent = time.perf_counter()
        sock.sendall(head + data)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError("server closed the connection before answering")
            received += chunk
        headers = time.perf_counter()
        status = received.split(b"\r\n", 1)[0].decode()
        if " 200 " not in status + " ":
            raise RuntimeError(f"hang-up request answered {status}")
        if reused is not None:  # the lookup ran before the headers went out
            reused = (cached_tokens_metric(client) or 0) - reused
        time.sleep(max(0.0, headers + after - time.perf_counter()))
        before = engine_state(client)
        closed = time.perf_counter()
        sock.close()
        polls = 0
        deadline = closed + timeout
        while True:
            state = engine_state(client)
            polls += 1
            now = time.perf_counter()
            if not state.get("active_sequences") and not state.get("queued_requests"):
                break
            if now > deadline:
                return {"idle_s": None, "timed_out_after_s": timeout, "state": state}
            time.sleep(0.02)
        idle = now - closed
        time.sleep(0.3)
        later = engine_state(client)
    return {
        "idle_s": round(idle, 3),
        "prompt_tokens_reused": reused,
        "headers_after_s": round(headers - sent, 3),
        "closed_after_headers_s": round(closed - headers, 3),
        "steps_after_hangup": _diff(state, before, "steps"),
        "steps_after_idle": _diff(later, state, "steps"),
        "polls": polls,
    }


def _diff(a: dict[str, Any], b: dict[str, Any], key: str) -> int | None:
    return a[key] - b[key] if key in a and key in b else None


def measure(args: argparse.Namespace, server: Server, prompts: Prompts) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    results: dict[str, Any] = {}
    client = httpx.Client(base_url=server.url, timeout=1800)

    log("warm-up")
    for i, size in enumerate((32, 600)):
        run_stream(client, body(prompts.text(f"warm-up {i}", size), 8, f"warm-{i}-{run_id}"))

    # 1. Prefill speed (the long one leaves the large entry in the cache).
    log(f"prefill: {args.mid} tokens")
    results["prefill_mid"] = prefill(client, prompts.text("M", args.mid), f"prefill-mid-{run_id}")
    log(f"  {results['prefill_mid']}")
    big_salt = f"big-{run_id}"
    big_text = prompts.text("L", args.long)
    log(f"prefill: {args.long} tokens (stays cached)")
    results["prefill_long"] = prefill(client, big_text + "\n\nSummarize these notes.", big_salt)
    log(f"  {results['prefill_long']}")

    # 2. Hang-up during a long prefill.
    log(f"hang-up {args.hangup_after} s into a {args.long}-token prefill")
    results["hangup"] = hangup(
        server,
        prompts.text("H", args.long),
        f"hangup-{run_id}",
        args.hangup_after,
        args.idle_timeout,
    )
    log(f"  {results['hangup']}")
    wait_idle(client, args.idle_timeout)

    # 3 and 4. /health and inter-token gaps under load.
    poller = HealthPoller(server.url, args.poll_interval)
    poller.start()
    t0 = time.perf_counter()
    time.sleep(args.health_seconds)
    health: dict[str, Any] = {"idle": summary(poller.latencies(t0, time.perf_counter()), 50, 99)}
    gap: dict[str, Any] = {}

    log(f"{args.streams} streams decoding")
    decoders = Decoders(server.url, args.streams, args.stream_tokens, run_id)
    decoders.start()
    deadline = time.perf_counter() + 300
    while not decoders.running(min_deltas=20):
        if time.perf_counter() > deadline or decoders.errors:
            raise RuntimeError(f"streams did not start: {decoders.errors[:3]}")
        time.sleep(0.1)
    t0 = time.perf_counter()
    time.sleep(args.health_seconds)
    t1 = time.perf_counter()
    health["streams"] = summary(poller.latencies(t0, t1), 50, 99)
    gap["streams"] = summary(gaps(decoders.streams, t0, t1), 50, 95)

    log(f"{args.lookups} lookup(s) sharing ~{args.shared} tokens with the cached entry")
    windows, lookups = [], []
    step = max(16, args.shared // 20)
    for k in range(args.lookups):
        shared = prompts.cut(big_text, args.shared + k * step)
        tail = prompts.text(f"Q{k}", 100)
        t0 = time.perf_counter()
        lookups.append(prefill(client, f"{shared}\n\nQuestion {k}: {tail}", big_salt))
        windows.append((t0, time.perf_counter()))
        time.sleep(1.0)
    health["lookups"] = summary([x for w in windows for x in poller.latencies(*w)], 50, 99)
    gap["lookups"] = summary([x for w in windows for x in gaps(decoders.streams, *w)], 50, 95)
    results["lookups"] = lookups
    log(f"  {lookups}")

    log(f"a {args.mid}-token prefill while the streams decode")
    t0 = time.perf_counter()
    results["prefill_mid_under_load"] = prefill(
        client, prompts.text("P", args.mid), f"prefill-load-{run_id}"
    )
    t1 = time.perf_counter()
    health["mid_prefill"] = summary(poller.latencies(t0, t1), 50, 99)
    gap["mid_prefill"] = summary(gaps(decoders.streams, t0, t1), 50, 95)
    log(f"  {results['prefill_mid_under_load']}")
    time.sleep(1.0)

    decoders.stop()
    poller.stop.set()
    poller.join(timeout=130)
    wait_idle(client, args.idle_timeout)

    # 2b. Hang-up deep in a long prefill: the prompt resumes from the first
    # --hangup-from tokens of the cached entry, so the engine is already at that
    # context (where a prefill chunk costs the most) when the client leaves. Last,
    # because the partial KV it leaves in the cache would shorten the lookups.
    if 0 < args.hangup_from < args.long:
        log(
            f"hang-up {args.hangup_after} s into a {args.long}-token prefill resumed at token ~{args.hangup_from}"
        )
        prefix = prompts.cut(big_text, args.hangup_from)
        rest = prompts.text("HD", args.long - args.hangup_from)
        results["hangup_deep"] = hangup(
            server, f"{prefix}\n\n{rest}", big_salt, args.hangup_after, args.idle_timeout
        )
        log(f"  {results['hangup_deep']}")
        wait_idle(client, args.idle_timeout)
    client.close()
    results["health_ms"] = health
    results["gap_ms"] = gap
    results["streams"] = {
        "requests": len(decoders.streams),
        "restarts": decoders.restarts,
        "errors": decoders.errors[:5],
        "tokens": sum(len(s.deltas) for s in decoders.streams),
    }
    results["health_poll_errors"] = poller.errors
    return results


# ---------------------------------------------------------------------------
# Report


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def report(out: dict[str, Any]) -> None:
    r, a = out["results"], out["args"]
    print(f"mlxtrio: {out['mlxtrio']}  ({out['commit']})")
    print(f"model: {out['model']}   streams: {a['streams']}   elapsed: {out['elapsed_s']:.0f} s")
    print(
        "load average (1/5/15 min): before "
        + " ".join(f"{x:.2f}" for x in out["load_before"])
        + ", after "
        + " ".join(f"{x:.2f}" for x in out["load_after"])
    )
    print()
    print("prefill, one output token (--mid and --long: nothing else running)")
    print(
        f"  {'':<22}{'prompt':>8}{'cached':>8}{'wall s':>9}{'TTFT s':>9}"
        f"{'tok/s':>9}{'(server)':>10}{'(client)':>10}"
    )
    rows = [
        (f"--mid {a['mid']}", r["prefill_mid"]),
        (f"--long {a['long']}", r["prefill_long"]),
        ("--mid under load", r["prefill_mid_under_load"]),
    ] + [(f"lookup {k + 1}", x) for k, x in enumerate(r["lookups"])]
    for name, p in rows:
        print(
            f"  {name:<22}{p['prompt_tokens']:>8}{p['cached_tokens']:>8}{p['wall_s']:>9.2f}"
            f"{_num(p['server_ttft_s'], 9, 2)}{_num(p['ttft_prefill_tok_s'], 9, 0)}"
            f"{_num(p['server_prefill_tok_s'], 10, 0)}{_num(p['client_prefill_tok_s'], 10, 0)}"
        )
    print("  tok/s = prefilled tokens / server TTFT; (server) = the server's own")
    print("  prefill_tokens_per_second; (client) = prefilled tokens / request wall time")
    print()
    print(f"{'/health latency, ms':<46}{'n':>6}{'p50':>9}{'p99':>9}{'max':>9}")
    labels = {
        "idle": "idle",
        "streams": f"{a['streams']} streams decoding, {a['long']}-token entry",
        "lookups": f"  + lookups sharing ~{a['shared']} tokens",
        "mid_prefill": f"  + a {a['mid']}-token prefill",
    }
    for key, label in labels.items():
        h = r["health_ms"][key]
        print(
            f"  {label:<44}{h['n']:>6}{_ms(h['p50_ms']):>9}{_ms(h['p99_ms']):>9}{_ms(h['max_ms']):>9}"
        )
    print()
    print(f"{'inter-token gap of the streams, ms':<46}{'n':>6}{'p50':>9}{'p95':>9}{'max':>9}")
    for key, label in list(labels.items())[1:]:
        g = r["gap_ms"][key]
        label = "decoding alone" if key == "streams" else label
        print(
            f"  {label:<44}{g['n']:>6}{_ms(g['p50_ms']):>9}{_ms(g['p95_ms']):>9}{_ms(g['max_ms']):>9}"
        )
    print("  goal during the prefill: p95 <= 500 ms")
    print()
    for key, where in (("hangup", "fresh"), ("hangup_deep", f"resumed at ~{a['hangup_from']}")):
        h = r.get(key)
        if h is None:
            continue
        what = f"hang-up during a {a['long']}-token prefill ({where})"
        if h.get("idle_s") is None:
            print(f"{what}: NOT idle after {h['timed_out_after_s']} s")
            continue
        print(
            f"{what}, {h['closed_after_headers_s']:.1f} s after the headers: engine idle after "
            f"{h['idle_s']:.2f} s (goal < 1 s); engine steps after it: {h['steps_after_hangup']}; "
            f"prompt tokens reused: {h['prompt_tokens_reused']}"
        )
    s = r["streams"]
    if s["restarts"] or s["errors"] or r["health_poll_errors"]:
        print(
            f"note: {s['restarts']} stream restarts, errors {s['errors']}, "
            f"{r['health_poll_errors']} failed /health polls"
        )


def _num(v: Any, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width},.{digits}f}"


# ---------------------------------------------------------------------------


def random_weights_model() -> str:
    """The embedded model's architecture and tokenizer with seeded random weights
    (built once, then reused, so that runs against different trees share it)."""
    out = Path(tempfile.gettempdir()) / "mlxtrio-bench-random-tiny-seed0"
    if not (out / "model.safetensors").exists():
        log(f"building a random-weights copy of the embedded model in {out}")
        tmp = out.with_name(out.name + f".{os.getpid()}")
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "build_embedded_model.py"), "--seed", "0"]
            + ["--out", str(tmp)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        tmp.rename(out)
    return str(out)


def tree_commit(tree: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git tree"
    return f"{head}{' + uncommitted changes' if dirty else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="mlxtrio tree to serve from")
    parser.add_argument(
        "--model",
        default="random",
        help="random (default: random-weights copy of the embedded model), embedded "
        "(the tree's mlxtrio/assets/tiny-chat) or a local model directory",
    )
    parser.add_argument("--long", type=int, default=30000, help="long prompt, tokens")
    parser.add_argument("--mid", type=int, default=8000, help="mid prompt, tokens")
    parser.add_argument("--shared", type=int, default=3000, help="tokens shared with the entry")
    parser.add_argument("--streams", type=int, default=8, help="streams decoding")
    parser.add_argument("--lookups", type=int, default=3, help="shared-prefix requests")
    parser.add_argument("--health-seconds", type=float, default=10.0, help="per steady phase")
    parser.add_argument("--poll-interval", type=float, default=0.05, help="between /health polls")
    parser.add_argument("--hangup-after", type=float, default=3.0, help="s after the headers")
    parser.add_argument(
        "--hangup-from",
        type=int,
        help="tokens of the cached long entry the deep hang-up prompt resumes from "
        "(default: half of --long; 0: skip)",
    )
    parser.add_argument("--stream-tokens", type=int, default=8192, help="per stream request")
    parser.add_argument("--idle-timeout", type=float, default=120.0)
    parser.add_argument("--prefix-cache-bytes", type=int, default=4 << 30)
    parser.add_argument("--port", type=int, default=18631)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.hangup_from is None:
        args.hangup_from = args.long // 2
    tree = args.tree.resolve()
    if args.model == "random":
        model_path = random_weights_model()
    elif args.model == "embedded":
        model_path = str(tree / "mlxtrio" / "assets" / "tiny-chat")
    else:
        model_path = args.model

    load_before = os.getloadavg()
    started = time.perf_counter()
    prompts = Prompts(model_path)
    server = Server(
        tree=tree,
        model_path=model_path,
        port=args.port,
        capacity=args.streams + 2,
        max_output_tokens=max(args.stream_tokens, 16),
        prefix_cache_bytes=args.prefix_cache_bytes,
    )
    try:
        server.start()
        results = measure(args, server, prompts)
    except BaseException:
        log(f"server log ({server.log_path}):\n{server.log_tail()}")
        raise
    finally:
        server.stop()
    out = {
        "tree": str(tree),
        "mlxtrio": server.imported,
        "commit": tree_commit(tree),
        "model": model_path,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "elapsed_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    print()
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
