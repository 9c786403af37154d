"""The server an agent runs against: one already answering, or one started
for the launch (and stopped after it), and what it serves."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..settings import Settings
from .agents import (
    FAILED_STATES,
    LOAD_TIMEOUT,
    POLL_INTERVAL,
    PROBE_TIMEOUT,
    READY_STATES,
    STOP_MARGIN,
    LaunchError,
    Target,
    output_cap,
)


def client_url(settings: Settings) -> str:
    """Where a client on this machine reaches the server."""
    host = settings.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def first_key(api_key: str) -> str:
    """The key a client sends: the first of the server's (comma-separated) keys."""
    return next((k.strip() for k in api_key.split(",") if k.strip()), "")


class Unreachable(Exception):
    """Nothing answers at the server's address."""


class NotServed(LaunchError):
    """The server does not serve the model asked for."""


class ServerClient:
    """The few requests launch makes (urllib: nothing to install)."""

    def __init__(self, url: str, api_key: str = "") -> None:
        self.url = url
        self.api_key = api_key

    def get(self, path: str, timeout: float = PROBE_TIMEOUT) -> tuple[int, Any]:
        """``(status, JSON body or None)``; raises :class:`Unreachable`."""
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            raise Unreachable(str(exc)) from None
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, None

    def health(self) -> dict[str, Any] | None:
        """``/health`` (200 ready, 503 loading or failed), or None when
        nothing answers; :class:`LaunchError` when something else does."""
        try:
            status, body = self.get("/health")
        except Unreachable:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("models"), list):
            raise LaunchError(
                f"something other than mlxtrio answers at {self.url} (GET /health: {status}): "
                "stop it or pick another --port"
            )
        return body

    def model(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{name}``: the model's limits (an alias's too)."""
        status, body = self.get("/v1/models/" + urllib.parse.quote(name, safe="/"))
        if status == 200 and isinstance(body, dict):
            return body
        if status == 401:
            raise LaunchError(
                f"the server at {self.url} wants an API key: set MLXTRIO_API_KEY to one of its keys"
            )
        if status == 404:
            served = ", ".join(self.served()) or "nothing"
            raise NotServed(
                f"the server at {self.url} does not serve {name} (it serves {served}): "
                "ask for one of those with --model, or use another --port"
            )
        raise LaunchError(f"GET {self.url}/v1/models/{name}: unexpected status {status}")

    def served(self) -> list[str]:
        """The served models' names, the default first."""
        with contextlib.suppress(Unreachable):
            status, body = self.get("/v1/models")
            if status == 200 and isinstance(body, dict):
                return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]
        return []


def describe_load(load: Any) -> str:
    """A model's load progress as ``/health`` reports it, in a few words."""
    if isinstance(load, bool) or load is None:
        return ""
    if isinstance(load, int | float):
        return f"{load * 100:.0f}%" if load <= 1 else f"{load:.0f}%"
    if not isinstance(load, Mapping):
        return str(load)

    def pick(*names: str) -> Any:
        return next((load[n] for n in names if isinstance(load.get(n), int | float)), None)

    done = pick("done_bytes", "bytes_done", "read_bytes", "loaded_bytes", "done")
    total = pick("total_bytes", "bytes_total", "total")
    fraction = pick("fraction", "progress")
    percent = pick("percent")
    if fraction is None and percent is not None:
        fraction = percent / 100
    if fraction is None and done is not None and total:
        fraction = done / total
    parts = []
    if fraction is not None:
        parts.append(f"{fraction * 100:.0f}%")
    if done is not None and total:
        parts.append(f"{done / 1e9:.2f} of {total / 1e9:.2f} GB")
    if parts:
        return ", ".join(parts)
    return ", ".join(f"{k}={v}" for k, v in load.items() if isinstance(v, str | int | float))


class Progress:
    """One status line on a terminal (rewritten in place), else a line per
    change (at most one every few seconds)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.last_text = ""
        self.last_time = 0.0
        self.open = False

    def show(self, text: str) -> None:
        now = time.monotonic()
        line = f"mlxtrio: {text} ({now - self.started:.0f} s)"
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            self.open = True
        elif (
            text != self.last_text and now - self.last_time >= 2.0
        ) or now - self.last_time >= 15.0:
            self.stream.write(line + "\n")
            self.last_time = now
        else:
            return
        self.last_text = text
        self.stream.flush()

    def done(self, text: str | None = None) -> None:
        if self.open:
            self.stream.write("\r\x1b[K")
            self.open = False
        if text:
            self.stream.write(f"mlxtrio: {text}\n")
        self.stream.flush()


# ---------------------------------------------------------------------------
# A server of launch's own


def serve_argv(settings: Settings) -> list[str]:
    """``python -m mlxtrio serve`` for ``settings``: the address and the
    model given to launch; the rest of the settings reach the child through
    the ``MLXTRIO_*`` environment it inherits."""
    argv = [sys.executable, "-m", "mlxtrio", "serve", "--host", settings.host]
    argv += ["--port", str(settings.port)]
    if settings.model:
        argv += ["--model", settings.model]
    if settings.model_name:
        argv += ["--model-name", settings.model_name]
    if settings.context_length:
        argv += ["--context-length", str(settings.context_length)]
    return argv


def server_log_path(settings: Settings) -> Path:
    """Where a launched server's output goes (not the agent's terminal)."""
    name = f"launch-{settings.port}.log"
    try:
        settings.data_path.mkdir(parents=True, exist_ok=True)
        return settings.data_path / name
    except OSError:
        return Path(tempfile.gettempdir()) / f"mlxtrio-{name}"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the server gets SIGTERM if launch dies without stopping it."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


class ServerProcess:
    """``mlxtrio serve`` as a child of launch, in a session of its own (a
    Ctrl-C meant for the agent does not reach it)."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        grace: float = 5.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start it; its output (stdout and stderr) goes to ``log_path``,
        written afresh."""
        self.argv = list(argv)
        self.log_path = log_path
        self.grace = grace
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        except OSError:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM (the server finishes in-flight work for ``grace`` seconds),
        then SIGKILL if it is still there; returns its exit status."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=self.grace + STOP_MARGIN)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            return self.proc.returncode
        finally:
            self._log.close()


def wait_ready(
    client: ServerClient,
    name: str,
    *,
    server: ServerProcess | None = None,
    timeout: float = LOAD_TIMEOUT,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Wait until the server answers and ``name`` is ready, showing its
    state; returns its ``/v1/models`` entry. Raises :class:`LaunchError`
    when the server exits, the model fails or the time is up."""
    progress = progress or Progress()
    deadline = time.monotonic() + timeout
    engine: str | None = None
    state = "starting the server"
    while True:
        if server is not None and (status := server.exited()) is not None:
            progress.done()
            tail = server.tail()
            raise LaunchError(
                f"the server exited (status {status}) before {name} was ready; "
                f"its log ({server.log_path}) ends with:\n{tail}"
            )
        health = client.health()
        if health is not None:
            if engine is None:
                engine = str(client.model(name).get("alias_of") or name)
            entry = next((m for m in health["models"] if m.get("id") == engine), None)
            state = str(entry.get("state")) if entry else "ready"
            if entry is None or state in READY_STATES:
                progress.done()
                return client.model(name)
            if state in FAILED_STATES:
                progress.done()
                error = entry.get("error") or "no reason given"
                verb = "failed to load" if state == "failed" else f"is {state}"
                raise LaunchError(f"model {engine} {verb}: {error}")
            load = describe_load(entry.get("load", entry.get("load_progress")))
            state = f"{state} {engine}" + (f": {load}" if load else "")
        progress.show(state)
        if time.monotonic() > deadline:
            progress.done()
            raise LaunchError(
                f"{name} was not ready within {timeout:.0f} s ({state}); "
                "a larger --load-timeout waits longer"
            )
        time.sleep(POLL_INTERVAL)


# ---------------------------------------------------------------------------
# Resolving the target


def requested_model(settings: Settings) -> str | None:
    """The model name asked for, if any (``--model`` / ``--model-name``)."""
    return settings.served_model_name if settings.model or settings.model_name else None


def local_context(settings: Settings) -> int | None:
    """The context the server would serve, from the model's config on disk
    (for ``--print-config`` with no server running)."""
    own = None
    try:
        config = json.loads((Path(settings.model_path) / "config.json").read_text())
        text = config.get("text_config") or {}
        own = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        pass
    limits = [n for n in (own, settings.context_length) if isinstance(n, int) and n > 0]
    return min(limits) if limits else None


def target_from(settings: Settings, name: str, entry: Mapping[str, Any] | None) -> Target:
    """The target for ``name``, with the limits the server reported (or, with
    no ``entry``, the ones it would serve)."""
    if entry is not None:
        context = entry.get("context_window")
        served_output = entry.get("max_output_tokens")
    else:
        context, served_output = local_context(settings), None
    context = context if isinstance(context, int) and context > 0 else None
    served_output = served_output if isinstance(served_output, int) else None
    return Target(
        url=client_url(settings),
        model=name,
        context=context,
        output=output_cap(settings, served_output, context),
        api_key=first_key(settings.api_key),
    )


# ---------------------------------------------------------------------------
# The command
