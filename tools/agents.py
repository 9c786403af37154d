"""Drive the real agent CLIs headless against a server on the embedded model.

    python tools/agents.py [--clients claude,codex,opencode] [--agents-dir build/agents]
        [--timeout 600] [--first-timeout 1800] [--keep]

`make agents` installs the CLIs into build/agents and runs this. A server
(``python -m mlxtrio serve`` on a free port, a fresh data directory, its log
captured) serves the embedded model; each client works in a directory of its
own holding ``notes.txt``, with a fresh HOME (the user's configuration and
sessions are not touched), configured exactly as ``mlxtrio launch`` would
(:func:`mlxtrio.launch.plan`). Two runs per client:

1. read ``notes.txt`` and edit it (a tool call the client executes);
2. the same session resumed (``claude --continue``, ``codex exec resume
   --last``, ``opencode run --continue``): its first request should start
   from the prefix cache.

Claude Code drives ``/v1/messages``, Codex ``/v1/responses`` over its
WebSocket, OpenCode ``/v1/chat/completions``. One line per client: exit
statuses, model turns (generation requests in the server's access log),
tool calls executed (from the client's own JSON events, or Codex's session
files: the access log does not see them), 5xx answers (and hang-ups: a
request the client left before its answer), the share of prompt tokens read
from the cache, the first turn's time to first token (its whole prompt
prefilled cold; side requests such as OpenCode's title skipped), the resumed
run's first turn's cache share, and whether the edit landed. The embedded
model is tiny: a run that fails because of what the model wrote is reported
as it is.

Each run has a time limit (``--first-timeout`` for each client's first run,
which prefills its whole system prompt and tools: ~21k tokens for Claude
Code 2.1.332 in print mode; ``--timeout`` for the others); a client over it
is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxtrio import launch  # noqa: E402
from mlxtrio.launch.agents import install_hint  # noqa: E402
from mlxtrio.launch.server import ServerClient, target_from, wait_ready  # noqa: E402
from mlxtrio.settings import Settings  # noqa: E402

NOTES = "The secret word is pineapple.\nKeep this file short.\n"
FIRST_PROMPT = "Read notes.txt, then edit it: replace the word pineapple with mango."
SECOND_PROMPT = "Read notes.txt again and tell me what it says now."
MAX_TURNS = 24  # model turns per Claude Code run
LOG_SETTLE = 1.0  # seconds for the server's last access lines after a client exits

ACCESS = re.compile(
    r"mlxtrio\.access: (?P<method>\S+) (?P<path>.*?) (?P<status>\d{3}|-)(?P<fields>(?: \w+=\S+)*)$"
)


# ---------------------------------------------------------------------------
# The clients' commands and their JSON events


def claude_args(step: int) -> list[str]:
    args = ["-p", FIRST_PROMPT if step == 1 else SECOND_PROMPT]
    args += ["--output-format", "stream-json", "--verbose"]
    # Edits allowed, anything else that would ask is refused (nobody answers).
    args += ["--permission-mode", "acceptEdits", "--permission-prompts", "none"]
    # The tiny model can call Read over and over: a bounded run (Claude Code
    # itself has no limit in print mode; run 1 went 200+ turns, 2026-12-03).
    args += ["--max-turns", str(MAX_TURNS)]
    return args + (["--continue"] if step == 2 else [])


def codex_args(step: int) -> list[str]:
    flags = ["--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    if step == 1:
        return ["exec", *flags, FIRST_PROMPT]
    return ["exec", "resume", "--last", *flags, SECOND_PROMPT]


def opencode_args(step: int) -> list[str]:
    args = ["run", "--format", "json", "--auto"]
    if step == 2:
        args.append("--continue")
    return [*args, FIRST_PROMPT if step == 1 else SECOND_PROMPT]


def json_lines(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def claude_tools(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(tool results, failed ones) in Claude Code's stream-json events."""
    done = failed = 0
    for event in events:
        if event.get("type") != "user":
            continue
        content = (event.get("message") or {}).get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                done += 1
                failed += bool(block.get("is_error"))
    return done, failed


def no_tools(events: list[dict[str, Any]]) -> tuple[int, int]:
    return 0, 0


def codex_session_tools(home: Path) -> tuple[int, int]:
    """(tool outputs sent back to the model, 0) in Codex's session files:
    ``exec --json`` shows only shell and patch items, not every tool."""
    done = 0
    for rollout in (home / ".codex" / "sessions").rglob("rollout-*.jsonl"):
        for event in json_lines(rollout.read_text(errors="replace")):
            payload = event.get("payload")
            if (
                event.get("type") == "response_item"
                and isinstance(payload, dict)
                and str(payload.get("type", "")).endswith("_output")
                and "call_id" in payload
            ):
                done += 1
    return done, 0


def opencode_tools(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(tool parts finished, failed ones) in ``opencode run --format json`` events."""
    done = failed = 0
    for event in events:
        if event.get("type") != "tool_use":
            continue
        state = ((event.get("part") or {}).get("state")) or {}
        done += 1
        failed += state.get("status") == "error"
    return done, failed


@dataclass(frozen=True)
class Client:
    name: str  # launch's agent name
    api: str
    args: Callable[[int], list[str]]
    tools: Callable[[list[dict[str, Any]]], tuple[int, int]]  # from a run's stdout
    # from the client's files in HOME, after both runs (when stdout does not say)
    session_tools: Callable[[Path], tuple[int, int]] | None = None


CLIENTS = {
    "claude": Client("claude", "/v1/messages", claude_args, claude_tools),
    "codex": Client(
        "codex", "/v1/responses (WebSocket)", codex_args, no_tools, codex_session_tools
    ),
    "opencode": Client("opencode", "/v1/chat/completions", opencode_args, opencode_tools),
}


# ---------------------------------------------------------------------------
# The server's access log


@dataclass
class Access:
    method: str
    path: str
    status: str
    fields: dict[str, str]

    def number(self, name: str) -> float | None:
        value = self.fields.get(name)
        if value is None:
            return None
        try:
            return float(value.rstrip("s"))
        except ValueError:
            return None

    @property
    def is_turn(self) -> bool:
        """A generation (not a warm-up, a /health or a /v1/models)."""
        return "generated" in self.fields


def access_lines(text: str) -> list[Access]:
    found = []
    for line in text.splitlines():
        match = ACCESS.search(line)
        if match:
            fields = dict(f.split("=", 1) for f in match["fields"].split())
            found.append(Access(match["method"], match["path"], match["status"], fields))
    return found


class ServerLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def offset(self) -> int:
        return self.path.stat().st_size

    def since(self, offset: int) -> list[Access]:
        with self.path.open("rb") as log:
            log.seek(offset)
            return access_lines(log.read().decode(errors="replace"))


# ---------------------------------------------------------------------------
# Running a client


@dataclass
class Step:
    status: int | None  # None: killed at the time limit
    seconds: float
    accesses: list[Access]
    tools: tuple[int, int]


@dataclass
class Result:
    client: str
    steps: list[Step] = field(default_factory=list)
    edited: bool = False
    missing: str = ""

    @property
    def server_errors(self) -> int:
        return sum(
            a.status.isdigit() and int(a.status) >= 500 for s in self.steps for a in s.accesses
        )

    def line(self) -> str:
        if self.missing:
            return f"{self.client:<9} not run: {self.missing}"
        accesses = [a for s in self.steps for a in s.accesses]
        turns = [a for a in accesses if a.is_turn]
        prompt = sum(a.number("prompt") or 0 for a in turns)
        cached = sum(a.number("cached") or 0 for a in turns)
        server_errors = self.server_errors
        hung_up = sum(a.status == "-" for a in accesses)
        tools = sum(s.tools[0] for s in self.steps)
        failed = sum(s.tools[1] for s in self.steps)
        first = main_turn(self.steps[0].accesses) if self.steps else None
        ttft = first.number("ttft") if first else None
        resumed = main_turn(self.steps[1].accesses) if len(self.steps) > 1 else None
        statuses = "/".join("timeout" if s.status is None else str(s.status) for s in self.steps)
        parts = [
            f"{self.client:<9}",
            f"exit {statuses}",
            f"turns {len(turns)}",
            f"tool calls {tools}" + (f" ({failed} failed)" if failed else ""),
            f"5xx {server_errors}" + (f" (hang-ups {hung_up})" if hung_up else ""),
            f"cached {cached / prompt:.0%}" if prompt else "cached -",
            f"first TTFT {ttft:.1f}s" if ttft is not None else "first TTFT -",
            f"resumed from cache {_share(resumed)}",
            f"edit {'yes' if self.edited else 'no'}",
            f"({sum(s.seconds for s in self.steps):.0f} s)",
        ]
        return "  ".join(parts)


def main_turn(accesses: list[Access]) -> Access | None:
    """A run's first turn of the agent's own conversation: the first
    generation carrying at least half the run's largest prompt (OpenCode's
    title request, a short prompt of its own, comes first)."""
    turns = [a for a in accesses if a.is_turn]
    largest = max((a.number("prompt") or 0 for a in turns), default=0)
    return next((a for a in turns if (a.number("prompt") or 0) >= largest / 2), None)


def _share(access: Access | None) -> str:
    if access is None:
        return "-"
    prompt, cached = access.number("prompt"), access.number("cached") or 0
    return f"{cached / prompt:.0%} of {prompt:.0f}" if prompt else "-"


def run_step(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float, out: Path
) -> tuple[int | None, float, str]:
    """Run one client command; (status or None on timeout, seconds, stdout)."""
    started = time.monotonic()
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            status: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
            _stop_group(proc)
    return status, time.monotonic() - started, out.read_text(errors="replace")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """End the client started here and the processes it started (its own
    process group), politely first."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def find_binary(name: str, agents_dir: Path) -> str | None:
    local = agents_dir / "node_modules" / ".bin" / name
    if local.exists():
        return str(local)
    return launch.find_agent(name)


def version(binary: str, env: dict[str, str]) -> str:
    try:
        done = subprocess.run(
            [binary, "--version"], env=env, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "?"


def drive(
    client: Client,
    binary: str,
    target: launch.Target,
    home: Path,
    work: Path,
    log: ServerLog,
    timeouts: tuple[float, float],
) -> Result:
    project = work / client.name
    project.mkdir()
    (project / "notes.txt").write_text(NOTES)
    result = Result(client.name)
    for step in (1, 2):
        agent_plan = launch.plan(client.name, target, binary, client.args(step))
        env = agent_plan.environment(_isolated(os.environ, home))
        offset = log.offset()
        out = work / f"{client.name}-{step}.out"
        print(f"  run {step}: {client.name} {shlex.join(client.args(step))}", flush=True)
        status, seconds, stdout = run_step(
            agent_plan.argv, env, project, timeouts[0] if step == 1 else timeouts[1], out
        )
        time.sleep(LOG_SETTLE)
        step_result = Step(status, seconds, log.since(offset), client.tools(json_lines(stdout)))
        result.steps.append(step_result)
        print(
            f"    exit {status} after {seconds:.0f} s, {len(step_result.accesses)} requests",
            flush=True,
        )
    if client.session_tools is not None:
        result.steps[-1].tools = client.session_tools(home)
    result.edited = "mango" in (project / "notes.txt").read_text()
    return result


def _isolated(environ: Mapping[str, str], home: Path) -> dict[str, str]:
    """The environment with a fresh HOME (and XDG directories in it), and no
    agent configuration of the user's."""
    env = {
        k: v
        for k, v in environ.items()
        if not k.startswith(("CLAUDE_", "ANTHROPIC_", "CODEX_", "OPENCODE_", "XDG_"))
        and k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL")
    }
    env["HOME"] = str(home)
    for name, sub in (
        ("XDG_CONFIG_HOME", ".config"),
        ("XDG_DATA_HOME", ".local/share"),
        ("XDG_STATE_HOME", ".local/state"),
        ("XDG_CACHE_HOME", ".cache"),
    ):
        env[name] = str(home / sub)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="claude,codex,opencode")
    parser.add_argument("--agents-dir", type=Path, default=ROOT / "build" / "agents")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per resumed run")
    parser.add_argument(
        "--first-timeout", type=float, default=1800.0, help="seconds per client's first run"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        parser.error(f"unknown client(s): {', '.join(unknown)}")

    root = Path(tempfile.mkdtemp(prefix="mlxtrio-agents-"))
    home, work, data = root / "home", root / "work", root / "data"
    for place in (home, work, data):
        place.mkdir()
    port = _free_port()
    settings = Settings.from_env(environ={}, port=port, data_dir=str(data))
    env = {**os.environ, "MLXTRIO_LOG_LEVEL": "info"}
    env = {k: v for k, v in env.items() if not k.startswith("MLXTRIO_") or k == "MLXTRIO_LOG_LEVEL"}
    env["MLXTRIO_DATA_DIR"] = str(data)
    server = launch.ServerProcess(
        launch.serve_argv(settings), root / "server.log", settings.shutdown_grace, env
    )
    print(f"server: pid {server.pid} on {launch.client_url(settings)}, log {server.log_path}")
    results: list[Result] = []
    try:
        client = ServerClient(launch.client_url(settings))
        entry = wait_ready(client, settings.served_model_name, server=server, timeout=120)
        target = target_from(settings, settings.served_model_name, entry)
        print(
            f"model: {target.model}, context {target.context}, output cap {target.output}; "
            f"work directory {root}"
        )
        log = ServerLog(server.log_path)
        for name in names:
            binary = find_binary(name, args.agents_dir)
            if binary is None:
                results.append(Result(name, missing=install_hint(name)))
                continue
            print(
                f"{name} {version(binary, _isolated(os.environ, home))} ({CLIENTS[name].api}):",
                flush=True,
            )
            timeouts = (args.first_timeout, args.timeout)
            results.append(drive(CLIENTS[name], binary, target, home, work, log, timeouts))
    except launch.LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        status = server.stop()
        print(f"server stopped (status {status})")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    for result in results:
        print(result.line())
    # The model's quality is not judged; the server's answers and the set-up are.
    broken = [r for r in results if r.missing or r.server_errors]
    return 1 if broken else 0


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
