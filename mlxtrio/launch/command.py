"""``mlxtrio launch``'s command line: parse, plan, print or run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..settings import Settings, SettingsError
from .agents import (
    AGENTS,
    LOAD_TIMEOUT,
    SETTINGS_OPTIONS,
    LaunchError,
    find_agent,
    install_hint,
    plan,
)
from .server import (
    NotServed,
    Progress,
    ServerClient,
    ServerProcess,
    client_url,
    first_key,
    requested_model,
    serve_argv,
    server_log_path,
    target_from,
    wait_ready,
)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        dest="model",
        help="model path or hub id to serve, or the served name to use (default: the server's)",
    )
    parser.add_argument("--model-name", dest="model_name", help="public name of --model")
    parser.add_argument("--host", dest="host", help="the server's address (default 127.0.0.1)")
    parser.add_argument("--port", dest="port", type=int, help="the server's port (default 8000)")
    parser.add_argument(
        "--context-length",
        dest="context_length",
        type=int,
        help="tokens of context, when launch starts the server",
    )
    parser.add_argument(
        "--load-timeout",
        dest="load_timeout",
        type=float,
        help=f"seconds to wait for the model to be ready (default {LOAD_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--print-config",
        dest="print_config",
        action="store_true",
        help="print the address, environment and command, start nothing",
    )


def add_parser(subparsers: Any) -> None:
    """Add ``launch`` to ``mlxtrio``'s subcommands.

    Its options may come before or after the agent's name; everything after
    the first ``--`` that follows the name goes to the agent. Those after the
    name are parsed in :func:`run` (argparse cannot tell them apart from the
    agent's), which applies them on top of the settings it is given."""
    parser = subparsers.add_parser(
        "launch",
        help="run Claude Code, Codex or OpenCode against this server",
        description=(
            "Run a coding agent against the server on the configured address (started "
            "for the agent's lifetime if nothing answers there), configured for its model."
        ),
        usage="%(prog)s {claude,codex,opencode} [options] [-- AGENT_ARGS...]",
    )
    _add_options(parser)
    parser.add_argument(
        "launch_argv",
        nargs=argparse.REMAINDER,
        metavar="{claude,codex,opencode} [options] [-- AGENT_ARGS...]",
        help="the agent, launch's options, then the agent's own arguments after --",
    )


@dataclass
class Invocation:
    agent: str
    agent_args: list[str]
    print_config: bool
    load_timeout: float
    settings: Settings


def parse_invocation(args: argparse.Namespace, settings: Settings) -> Invocation:
    """The agent, its arguments and the settings in force, from ``args``
    (the options before the agent's name are already in ``settings``)."""
    rest = list(getattr(args, "launch_argv", None) or [])
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] not in AGENTS:
        got = f" (got {rest[0]!r})" if rest else ""
        raise LaunchError(f"which agent? launch one of: {', '.join(AGENTS)}{got}")
    agent, rest = rest[0], rest[1:]
    own, agent_args = (
        (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    )
    later = argparse.ArgumentParser(
        prog=f"mlxtrio launch {agent}", argument_default=argparse.SUPPRESS, add_help=True
    )
    _add_options(later)
    try:
        options, unknown = later.parse_known_args(own)
    except SystemExit as exc:
        if not exc.code:  # --help
            raise
        raise LaunchError(f"bad launch options: {shlex.join(own)}") from None
    if unknown:
        raise LaunchError(
            f"unknown launch option {unknown[0]!r}: the agent's own arguments go after --, "
            f"as in: mlxtrio launch {agent} -- {shlex.join(unknown)}"
        )
    found = vars(options)
    overrides = {k: found[k] for k in SETTINGS_OPTIONS if found.get(k) is not None}
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
        try:
            settings.validate()
        except SettingsError as exc:
            raise LaunchError(str(exc)) from None
    timeout = found.get("load_timeout", getattr(args, "load_timeout", None)) or LOAD_TIMEOUT
    return Invocation(
        agent=agent,
        agent_args=agent_args,
        print_config=bool(found.get("print_config") or getattr(args, "print_config", False)),
        load_timeout=float(timeout),
        settings=settings,
    )


def _error(message: str) -> None:
    print(f"mlxtrio launch: error: {message}", file=sys.stderr)


def _warn(message: str) -> None:
    print(f"mlxtrio launch: warning: {message}", file=sys.stderr)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``mlxtrio launch``: returns the agent's exit status (1 when launch
    itself fails, 127 when the agent is not installed)."""
    try:
        invocation = parse_invocation(args, settings)
    except LaunchError as exc:
        _error(str(exc))
        return 2
    settings = invocation.settings
    binary = find_agent(invocation.agent)
    client = ServerClient(client_url(settings), first_key(settings.api_key))
    try:
        if invocation.print_config:
            return print_config(invocation, client, binary)
        if binary is None:
            _error(install_hint(invocation.agent))
            return 127
        return _launch(invocation, client, binary)
    except LaunchError as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def print_config(invocation: Invocation, client: ServerClient, binary: str | None) -> int:
    """What launch would set, as shell lines; starts nothing."""
    settings = invocation.settings
    health = client.health()
    name = requested_model(settings)
    entry = None
    if health is not None:
        name = name or next(iter(client.served()), None) or settings.served_model_name
        try:
            entry = client.model(name)
        except NotServed as exc:
            _warn(str(exc))
        status = health.get("status")
        where = "running" + ("" if status == "ok" else f", {status}")
    else:
        name = name or settings.served_model_name
        where = "not running: launch would start " + shlex.join(
            ["mlxtrio", *serve_argv(settings)[3:]]
        )
    target = target_from(settings, name, entry)
    agent_plan = plan(invocation.agent, target, binary or invocation.agent, invocation.agent_args)
    for warning in agent_plan.warnings:
        _warn(warning)
    context = f"{target.context} tokens" if target.context else "unknown until the model loads"
    lines = [
        f"# mlxtrio launch {invocation.agent}",
        f"# server: {target.url} ({where})",
        f"# model: {target.model}, context {context}, output cap {target.output} tokens",
    ]
    if binary is None:
        lines.append(f"# {install_hint(invocation.agent)}")
    lines += agent_plan.shell_lines()
    print("\n".join(lines))
    return 0


def _launch(invocation: Invocation, client: ServerClient, binary: str) -> int:
    settings = invocation.settings
    server: ServerProcess | None = None
    progress = Progress()
    try:
        health = client.health()
        if health is None:
            log_path = server_log_path(settings)
            server = ServerProcess(serve_argv(settings), log_path, settings.shutdown_grace)
            print(
                f"mlxtrio: starting the server on {client.url} (pid {server.pid}, log {log_path})",
                file=sys.stderr,
                flush=True,
            )
            name: str | None = settings.served_model_name
        else:
            name = requested_model(settings) or next(iter(client.served()), None)
            print(f"mlxtrio: using the server at {client.url}", file=sys.stderr, flush=True)
        if name is None:
            raise LaunchError(f"the server at {client.url} serves no model")
        entry = wait_ready(
            client, name, server=server, timeout=invocation.load_timeout, progress=progress
        )
        target = target_from(settings, name, entry)
        agent_plan = plan(invocation.agent, target, binary, invocation.agent_args)
        for warning in agent_plan.warnings:
            _warn(warning)
        context = f"{target.context}-token context" if target.context else "context unknown"
        print(
            f"mlxtrio: {invocation.agent} on {target.model} ({context}, "
            f"output cap {target.output}) at {target.url}",
            file=sys.stderr,
            flush=True,
        )
        return run_agent(agent_plan.argv, agent_plan.environment(os.environ))
    finally:
        progress.done()
        if server is not None:
            print("mlxtrio: stopping the server", file=sys.stderr, flush=True)
            status = server.stop()
            if status not in (0, None, -signal.SIGTERM):
                print(
                    f"mlxtrio: the server exited with status {status} (log {server.log_path})",
                    file=sys.stderr,
                )


def run_agent(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the agent in the foreground; its exit status (128 + N when a
    signal N ended it). In the main thread, a Ctrl-C is the agent's alone
    (launch ignores it while the agent runs) and a SIGTERM or SIGHUP sent to
    launch is passed on to the agent."""
    try:
        proc = subprocess.Popen(list(argv), env=dict(env))
    except OSError as exc:
        raise LaunchError(f"cannot run {argv[0]}: {exc}") from None
    with _signals_to(proc):
        status = proc.wait()
    return 128 - status if status < 0 else status


@contextlib.contextmanager
def _signals_to(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGHUP: signal.signal(signal.SIGHUP, forward),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the ``MLXTRIO_*`` environment and launch's options given
    before the agent's name (``python -m mlxtrio.launch``)."""
    return Settings.from_env(**{k: getattr(args, k, None) for k in SETTINGS_OPTIONS})


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mlxtrio.launch AGENT ...``: the same as ``mlxtrio launch``."""
    parser = argparse.ArgumentParser(prog="mlxtrio")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["launch", *(sys.argv[1:] if argv is None else argv)])
    try:
        settings = settings_from(args)
    except SettingsError as exc:
        _error(str(exc))
        return 2
    return run(args, settings)
