"""``mlxtrio launch``: each agent gets exactly this server and model.

A stand-in agent (a Python script that writes its argv, environment and what
``/health`` answered to a JSON file, then exits with a chosen status) takes
the agent's place through ``MLXTRIO_AGENT_BIN_<NAME>``. Launch reuses the
test's server, or, run as a process, starts and stops one of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxtrio import launch
from mlxtrio.settings import Settings

from .conftest import MODEL, ServerFactory, free_port

STUB = """\
#!{python}
import json, os, sys, urllib.request
record = {{"argv": sys.argv[1:], "env": dict(os.environ), "health": None}}
base = os.environ.get("ANTHROPIC_BASE_URL")
if base:
    with urllib.request.urlopen(base + "/health", timeout=10) as response:
        record["health"] = response.status
with open(os.environ["STUB_AGENT_OUT"], "w") as out:
    json.dump(record, out)
sys.exit(int(os.environ.get("STUB_AGENT_EXIT", "0")))
"""

CLAUDE_UNSET = (
    "ANTHROPIC_API_KEY",
    "CLAUDE_CODE_OAUTH_TOKEN",
    "ANTHROPIC_UNIX_SOCKET",
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_USE_FOUNDRY",
    "CLAUDE_CODE_USE_MANTLE",
    "CLAUDE_CODE_USE_ANTHROPIC_AWS",
    "CLAUDE_CODE_USE_ANTHROPIC_GOOGLE_CLOUD",
)


class Stub:
    """The stand-in agent and what it recorded."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "agent"
        self.path.write_text(STUB.format(python=sys.executable))
        self.path.chmod(0o755)
        self.out = tmp_path / "agent-record.json"

    def env(self, agent: str, exit_status: int = 0) -> dict[str, str]:
        return {
            launch.BIN_OVERRIDE + agent.upper(): str(self.path),
            "STUB_AGENT_OUT": str(self.out),
            "STUB_AGENT_EXIT": str(exit_status),
        }

    def stand_in_for(
        self, agent: str, monkeypatch: pytest.MonkeyPatch, exit_status: int = 0
    ) -> None:
        """Make ``launch`` run this stub as ``agent`` (for the test's duration)."""
        for name, value in self.env(agent, exit_status).items():
            monkeypatch.setenv(name, value)

    @property
    def record(self) -> dict[str, Any]:
        return json.loads(self.out.read_text())


@pytest.fixture
def stub(tmp_path: Path) -> Stub:
    return Stub(tmp_path)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mlxtrio")
    launch.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["launch", *argv])


async def run_launch(argv: list[str], **settings: Any) -> int:
    """``mlxtrio launch ARGV`` in a worker thread (the test's server runs on
    this one), with settings from the options alone (not the environment)."""
    args = parse(argv)
    options = {k: getattr(args, k, None) for k in launch.SETTINGS_OPTIONS}
    config = Settings.from_env(environ={}, **options, **settings)
    return await trio.to_thread.run_sync(launch.run, args, config)


def assert_environment(received: dict[str, str], expected: dict[str, str], unset=()) -> None:
    """The agent's environment is the caller's, less ``unset``, plus
    ``expected``."""
    for name, value in expected.items():
        assert received.get(name) == value, name
    for name in unset:
        assert name not in received, name
    for name, value in os.environ.items():
        if name not in expected and name not in unset:
            assert received.get(name) == value, name


def claude_environment(url: str, context: int, output: int, token: str) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": token,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_FABLE_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(context),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output),
        "API_TIMEOUT_MS": "1800000",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }


def empty_path(tmp_path: Path) -> str:
    bare = tmp_path / "bare-bin"
    bare.mkdir(exist_ok=True)
    return str(bare)


def read(path: Path) -> str:
    return path.read_text()


def server_logs(data_dir: Path) -> list[Path]:
    return list(data_dir.glob("launch-*.log"))


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------------------
# Each agent, on the test's server


async def test_claude_gets_the_server_and_model_in_its_environment(
    server_factory: ServerFactory,
    stub: Stub,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = await server_factory()
    stub.stand_in_for("claude", monkeypatch)
    # A real key and a cloud provider in the caller's environment must not reach it.
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-real-key")
    monkeypatch.setenv("CLAUDE_CODE_USE_BEDROCK", "1")
    status = await run_launch(
        ["claude", "--port", str(server.port), "--", "-p", "hello world", "--", "--model", "x"]
    )
    assert status == 0
    record = stub.record
    assert record["argv"] == ["-p", "hello world", "--", "--model", "x"]
    assert record["health"] == 200  # the server answered while the agent ran
    expected = claude_environment(server.url, 65536, 4096, "unused")
    assert_environment(record["env"], expected, CLAUDE_UNSET)
    err = capsys.readouterr().err
    assert f"using the server at {server.url}" in err
    assert "warning" not in err  # 64k: enough for Claude Code


async def test_claude_is_warned_about_a_short_context_and_uses_the_api_key(
    server_factory: ServerFactory,
    stub: Stub,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = await server_factory(context_length=32768, api_key="key-one,key-two")
    stub.stand_in_for("claude", monkeypatch, exit_status=3)
    status = await run_launch(["--port", str(server.port), "claude"], api_key="key-one,key-two")
    assert status == 3  # the agent's
    record = stub.record
    assert record["argv"] == []
    expected = claude_environment(server.url, 32768, 4096, "key-one")
    assert_environment(record["env"], expected, CLAUDE_UNSET)
    err = capsys.readouterr().err
    assert "warning: the served context (32768 tokens) is below the ~64k Claude Code needs" in err
    assert "compacts at 15672 tokens" in err


async def test_codex_gets_its_provider_through_config_overrides(
    server_factory: ServerFactory, stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await server_factory()
    stub.stand_in_for("codex", monkeypatch, exit_status=7)
    monkeypatch.delenv(launch.KEY_VARIABLE, raising=False)
    status = await run_launch(
        ["codex", "--port", str(server.port), "--", "exec", "--json", "-c", "x=1", "fix it"]
    )
    assert status == 7
    record = stub.record
    provider = (
        f'{{name="mlxtrio", base_url="{server.url}/v1", wire_api="responses", '
        f'env_key="MLXTRIO_LAUNCH_API_KEY", model_catalog_url="{server.url}/v1/models", '
        "supports_websockets=true, stream_idle_timeout_ms=1800000}"
    )
    assert record["argv"] == [
        "-c",
        'model_provider="mlxtrio"',
        "-c",
        f"model_providers.mlxtrio={provider}",
        "-c",
        f'model="{MODEL}"',
        "-c",
        "model_context_window=65536",
        "exec",
        "--json",
        "-c",
        "x=1",
        "fix it",
    ]
    # Each override is TOML, as Codex reads it.
    config: dict[str, Any] = {}
    for flag, value in zip(record["argv"][:8:2], record["argv"][1:8:2], strict=True):
        assert flag == "-c"
        config.update(tomllib.loads(value))
    assert config == {
        "model_provider": "mlxtrio",
        "model_providers": {
            "mlxtrio": {
                "name": "mlxtrio",
                "base_url": f"{server.url}/v1",
                "wire_api": "responses",
                "env_key": "MLXTRIO_LAUNCH_API_KEY",
                "model_catalog_url": f"{server.url}/v1/models",
                "supports_websockets": True,
                "stream_idle_timeout_ms": 1800000,
            }
        },
        "model": MODEL,
        "model_context_window": 65536,
    }
    assert_environment(record["env"], {"MLXTRIO_LAUNCH_API_KEY": "unused"})


async def test_opencode_gets_an_inline_config_and_the_model_flag(
    server_factory: ServerFactory, stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await server_factory(api_key="sekrit")
    stub.stand_in_for("opencode", monkeypatch)
    port = ["--port", str(server.port)]
    assert await run_launch(["opencode", *port], api_key="sekrit") == 0
    tui = stub.record
    assert tui["argv"] == ["-m", f"mlxtrio/{MODEL}"]
    config = json.loads(tui["env"]["OPENCODE_CONFIG_CONTENT"])
    assert config == {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlxtrio": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlxtrio",
                "options": {
                    "baseURL": f"{server.url}/v1",
                    "apiKey": "{env:MLXTRIO_LAUNCH_API_KEY}",
                    "headerTimeout": 1800000,
                    "chunkTimeout": 1800000,
                },
                "models": {MODEL: {"name": MODEL, "limit": {"context": 65536, "output": 4096}}},
            }
        },
        "model": f"mlxtrio/{MODEL}",
        "small_model": f"mlxtrio/{MODEL}",
    }
    assert_environment(
        tui["env"],
        {
            "OPENCODE_CONFIG_CONTENT": tui["env"]["OPENCODE_CONFIG_CONTENT"],
            "MLXTRIO_LAUNCH_API_KEY": "sekrit",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
        },
    )
    # `opencode run` takes -m after `run`; other subcommands take none.
    assert await run_launch(["opencode", *port, "--", "run", "say hi"], api_key="sekrit") == 0
    assert stub.record["argv"] == ["run", "-m", f"mlxtrio/{MODEL}", "say hi"]
    assert await run_launch(["opencode", *port, "--", "models"], api_key="sekrit") == 0
    assert stub.record["argv"] == ["models"]
    assert await run_launch(["opencode", *port, "--", "run", "-m", "a/b"], api_key="sekrit") == 0
    assert stub.record["argv"] == ["run", "-m", "a/b"]


async def test_a_model_the_server_does_not_serve_is_refused(
    server_factory: ServerFactory,
    stub: Stub,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = await server_factory()
    stub.stand_in_for("claude", monkeypatch)
    status = await run_launch(["claude", "--port", str(server.port), "--model", "qwen-huge"])
    assert status == 1
    assert not stub.out.exists()  # the agent never ran
    err = capsys.readouterr().err
    assert f"does not serve qwen-huge (it serves {MODEL})" in err


# ---------------------------------------------------------------------------
# --print-config, and no agent installed


async def test_print_config_names_the_running_server_without_the_agent_installed(
    server_factory: ServerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = await server_factory(api_key="sekrit")
    monkeypatch.delenv("MLXTRIO_AGENT_BIN_CLAUDE", raising=False)
    monkeypatch.setenv("PATH", empty_path(tmp_path))
    argv = ["claude", "--port", str(server.port), "--print-config", "--", "-p", "hi there"]
    assert await run_launch(argv, api_key="sekrit") == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:4] == [
        "# mlxtrio launch claude",
        f"# server: {server.url} (running)",
        f"# model: {MODEL}, context 65536 tokens, output cap 4096 tokens",
        "# claude is not installed (not on PATH): npm install -g @anthropic-ai/claude-code "
        "(or set MLXTRIO_AGENT_BIN_CLAUDE to its path)",
    ]
    assert lines[4] == "unset " + " ".join(CLAUDE_UNSET)
    environment = claude_environment(server.url, 65536, 4096, "sekrit")
    exports = [
        f"export {k}={v}"
        if k != "ANTHROPIC_AUTH_TOKEN"
        else f"# export {k}=<the server's API key: not shown>"
        for k, v in environment.items()
    ]
    assert lines[5:-1] == exports
    assert lines[-1] == "claude -p 'hi there'"
    assert "sekrit" not in out


async def test_print_config_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    monkeypatch.setenv("PATH", empty_path(tmp_path))
    for agent in launch.AGENTS:
        monkeypatch.delenv(launch.BIN_OVERRIDE + agent.upper(), raising=False)
    argv = ["codex", "--port", str(port), "--context-length", "32768", "--print-config"]
    assert await run_launch(argv, data_dir=str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert (
        f"# server: http://127.0.0.1:{port} (not running: launch would start mlxtrio serve "
        f"--host 127.0.0.1 --port {port} --context-length 32768)"
    ) in out
    assert f"# model: {MODEL}, context 32768 tokens, output cap 4096 tokens" in out
    assert "export MLXTRIO_LAUNCH_API_KEY=unused" in out
    assert out.splitlines()[-1].startswith("codex -c 'model_provider=\"mlxtrio\"'")
    assert out.splitlines()[-1].endswith(" -c model_context_window=32768")
    assert not listening(port)
    assert not server_logs(tmp_path)


async def test_an_agent_that_is_not_installed_is_named_with_its_npm_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    monkeypatch.setenv("PATH", empty_path(tmp_path))
    monkeypatch.delenv("MLXTRIO_AGENT_BIN_OPENCODE", raising=False)
    assert await run_launch(["opencode", "--port", str(port)], data_dir=str(tmp_path)) == 127
    err = capsys.readouterr().err
    assert "opencode is not installed (not on PATH): npm install -g opencode-ai" in err
    assert "starting the server" not in err  # checked before any server starts
    assert not listening(port)


# ---------------------------------------------------------------------------
# A server of launch's own (launch as a process)


def launch_process(
    argv: list[str], stub: Stub, agent: str, tmp_path: Path, exit_status: int = 0
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stub.env(agent, exit_status)}
    env["MLXTRIO_DATA_DIR"] = str(tmp_path / "data")
    env["MLXTRIO_LOG_LEVEL"] = "info"
    for name in ("MLXTRIO_API_KEY", "MLXTRIO_MODEL", "MLXTRIO_MODEL_NAME", "MLXTRIO_PORT"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "mlxtrio.launch", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_launch_starts_a_server_for_the_agent_and_stops_it_afterwards(
    stub: Stub, tmp_path: Path
) -> None:
    port = free_port()
    argv = ["claude", "--port", str(port), "--context-length", "65536", "--", "-p", "hi"]
    result = await trio.to_thread.run_sync(
        lambda: launch_process(argv, stub, "claude", tmp_path, exit_status=5)
    )
    assert result.returncode == 5, result.stderr
    record = stub.record
    assert record["argv"] == ["-p", "hi"]
    assert record["health"] == 200
    assert record["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert record["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"
    started = re.search(r"starting the server on \S+ \(pid (\d+), log (\S+)\)", result.stderr)
    assert started, result.stderr
    assert "stopping the server" in result.stderr
    assert gone(int(started.group(1)))
    assert not listening(port)
    log = read(Path(started.group(2)))
    assert "GET /health" in log
    assert "SIGTERM: finishing in-flight generations" in log


async def test_a_server_that_cannot_load_its_model_ends_the_launch(
    stub: Stub, tmp_path: Path
) -> None:
    port = free_port()
    missing = str(tmp_path / "no-such-model")
    argv = ["--model", missing, "--load-timeout", "60", "claude", "--port", str(port)]
    result = await trio.to_thread.run_sync(lambda: launch_process(argv, stub, "claude", tmp_path))
    assert result.returncode == 1, result.stderr
    assert "mlxtrio launch: error:" in result.stderr
    assert "no-such-model" in result.stderr
    assert not stub.out.exists()
    started = re.search(r"\(pid (\d+),", result.stderr)
    assert started and gone(int(started.group(1)))
    assert not listening(port)


# ---------------------------------------------------------------------------
# Parsing and small parts


def test_options_may_come_before_or_after_the_agent_and_its_args_after_dashes() -> None:
    base = Settings.from_env(environ={})

    def invocation(*argv: str) -> launch.Invocation:
        args = parse(list(argv))
        options = {k: getattr(args, k, None) for k in launch.SETTINGS_OPTIONS}
        settings = Settings.from_env(environ={}, **options)
        return launch.parse_invocation(args, settings)

    one = invocation("claude", "--port", "9001", "--model", "m", "--", "-p", "--", "--port", "x")
    assert (one.agent, one.agent_args) == ("claude", ["-p", "--", "--port", "x"])
    assert (one.settings.port, one.settings.model) == (9001, "m")
    two = invocation("--port", "9002", "--print-config", "codex", "--", "exec", "hi")
    assert (two.agent, two.agent_args, two.print_config) == ("codex", ["exec", "hi"], True)
    assert two.settings.port == 9002
    three = invocation("opencode", "--load-timeout", "5")
    assert (three.agent_args, three.load_timeout, three.settings) == ([], 5.0, base)
    with pytest.raises(launch.LaunchError, match="which agent"):
        invocation("aider")
    with pytest.raises(launch.LaunchError, match="go after --"):
        invocation("claude", "-p", "hi")


def test_load_progress_is_described_whatever_its_shape() -> None:
    assert launch.describe_load({"done_bytes": 1_500_000_000, "total_bytes": 3_000_000_000}) == (
        "50%, 1.50 of 3.00 GB"
    )
    # /health's own shape (models on demand)
    assert launch.describe_load({"read_bytes": 250_000_000, "total_bytes": 1_000_000_000}) == (
        "25%, 0.25 of 1.00 GB"
    )
    assert launch.describe_load({"fraction": 0.25}) == "25%"
    assert launch.describe_load({"percent": 80}) == "80%"
    assert launch.describe_load(0.5) == "50%"
    assert launch.describe_load(None) == ""
    assert launch.describe_load({"phase": "download"}) == "phase=download"


def test_the_server_address_for_clients() -> None:
    def url(host: str) -> str:
        return launch.client_url(Settings.from_env(environ={}, host=host, port=8123))

    assert url("127.0.0.1") == "http://127.0.0.1:8123"
    assert url("0.0.0.0") == "http://127.0.0.1:8123"
    assert url("::") == "http://[::1]:8123"
    assert url("localhost") == "http://localhost:8123"


def test_mlxtrio_cli_wires_launch() -> None:
    from mlxtrio import cli

    parser = cli.build_parser()
    choices = next(
        (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {}
    )
    assert "launch" in choices
    args = parser.parse_args(["launch", "--port", "9003", "codex", "--", "exec"])
    settings = cli.settings_from_args(args)
    invocation = launch.parse_invocation(args, settings)
    assert (invocation.agent, invocation.agent_args, settings.port) == ("codex", ["exec"], 9003)


def test_stopping_a_server_that_ignores_sigterm_kills_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = textwrap.dedent(
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("up", flush=True)
        time.sleep(60)
        """
    )
    monkeypatch.setattr(launch.server, "STOP_MARGIN", 0.5)
    server = launch.ServerProcess([sys.executable, "-c", script], tmp_path / "stubborn.log", 0.0)
    deadline = time.monotonic() + 10
    while "up" not in server.tail() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stop() == -signal.SIGKILL
