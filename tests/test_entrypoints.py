"""Entry points: hypercorn's asyncio worker is refused with one line; the CLI serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from mlxtrio.cli import build_parser, settings_from_args
from mlxtrio.settings import Settings, SettingsError

from .conftest import free_port

BIN = Path(sys.executable).parent


async def test_asyncio_worker_refuses_with_one_clear_line_and_fails() -> None:
    env = {**os.environ, "MLXTRIO_LOG_LEVEL": "warning"}
    result = await trio.run_process(
        [str(BIN / "hypercorn"), "--bind", "127.0.0.1:0", "mlxtrio.app:app"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )
    err = result.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert result.returncode != 0  # a service manager must see the failure
    assert lines[0] == (
        "error: mlxtrio needs hypercorn's trio worker: run `hypercorn -k trio mlxtrio.app:app` (or `mlxtrio serve`)"
    )
    # Ending hypercorn's supervisor may make Python's resource tracker note the
    # supervisor's semaphores it cleans up; nothing else may follow.
    assert all("resource_tracker" in line or "warnings.warn" in line for line in lines[1:]), lines
    assert "Traceback" not in err


async def test_mlxtrio_serve_cli_serves_and_shuts_down_gracefully(
    nursery: trio.Nursery, scripted_model_path: str
) -> None:
    port = free_port()
    proc = await nursery.start(
        lambda task_status: trio.run_process(
            [
                str(BIN / "mlxtrio"),
                "serve",
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--shutdown-grace",
                "0.5",
                "--model",
                scripted_model_path,
                "--model-name",
                "scripted",
            ],
            check=False,
            task_status=task_status,
        )
    )
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        with trio.fail_after(60):
            while True:
                try:
                    r = await client.get("/health")
                    if r.status_code == 200:
                        break
                    assert r.status_code == 503  # loading
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)
        r = await client.post(
            "/v1/responses", json={"model": "scripted", "input": "hi", "max_output_tokens": 4}
        )
        assert r.status_code == 200
        # A long stream in flight at shutdown still gets its terminal event.
        rest = await _start_long_stream_then(client, lambda: proc.send_signal(signal.SIGTERM))
    assert any("response.failed" in line for line in rest), rest[-3:]
    assert "server_shutting_down" in rest[-1] or any("server_shutting_down" in x for x in rest)
    with trio.fail_after(15):
        await proc.wait()
    assert proc.returncode == 0


async def _wait_healthy(client: httpx.AsyncClient) -> None:
    with trio.fail_after(60):
        while True:
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.1)


async def _start_long_stream_then(
    client: httpx.AsyncClient, action: Callable[[], None]
) -> list[str]:
    """Start a never-ending stream, run ``action`` once it decodes, and return
    the lines that followed until the server closed the stream."""
    body = {"model": "scripted", "input": "LOOP", "stream": True, "max_output_tokens": 30000}
    async with client.stream("POST", "/v1/responses", json=body) as stream:
        lines = stream.aiter_lines()
        async for line in lines:
            if "output_text.delta" in line:
                break
        action()
        return [line async for line in lines]


async def _start_plain_hypercorn(
    nursery: trio.Nursery, scripted_model_path: str, data_dir: Path
) -> tuple[int, trio.Process]:
    """`hypercorn -k trio mlxtrio.app:app` on the scripted model: (port, process)."""
    port = free_port()
    env = {
        **os.environ,
        "MLXTRIO_MODEL": scripted_model_path,
        "MLXTRIO_MODEL_NAME": "scripted",
        "MLXTRIO_DATA_DIR": str(data_dir),
        "MLXTRIO_LOG_LEVEL": "warning",
    }
    command = [str(BIN / "hypercorn"), "-k", "trio", "--bind", f"127.0.0.1:{port}"]
    proc = await nursery.start(
        lambda task_status: trio.run_process(
            [*command, "mlxtrio.app:app"], check=False, env=env, task_status=task_status
        )
    )
    return port, proc


POSIX_ONLY = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and ps")


@POSIX_ONLY
async def test_plain_hypercorn_drains_streams_on_sigterm(
    nursery: trio.Nursery, scripted_model_path: str, tmp_path: Path
) -> None:
    """SIGTERM to hypercorn's supervisor (docker stop, kill, systemd): the stream
    in flight still gets its terminal event within hypercorn's graceful timeout."""
    port, proc = await _start_plain_hypercorn(nursery, scripted_model_path, tmp_path)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        await _wait_healthy(client)
        with trio.fail_after(10):  # hypercorn's graceful timeout is 3 s
            rest = await _start_long_stream_then(client, lambda: proc.send_signal(signal.SIGTERM))
    events = [line for line in rest if line.startswith("event: ")]
    assert events[-1] == "event: response.failed", rest[-4:]
    assert any("server_shutting_down" in line for line in rest)
    with trio.fail_after(15):
        await proc.wait()
    assert proc.returncode == 0


@POSIX_ONLY
async def test_plain_hypercorn_worker_drains_on_its_own_sigterm(
    nursery: trio.Nursery, scripted_model_path: str, tmp_path: Path
) -> None:
    """SIGTERM to the worker process alone (systemd signals the whole control
    group): it drains, then hands back to hypercorn, which starts a new one."""
    port, proc = await _start_plain_hypercorn(nursery, scripted_model_path, tmp_path)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            await _wait_healthy(client)
            worker = _worker_of(proc.pid)
            with trio.fail_after(10):
                rest = await _start_long_stream_then(
                    client, lambda: os.kill(worker, signal.SIGTERM)
                )
            events = [line for line in rest if line.startswith("event: ")]
            assert events[-1] == "event: response.failed", rest[-4:]
            await _wait_healthy(client)  # hypercorn's replacement worker
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            await proc.wait()


def _worker_of(pid: int) -> int:
    """The pid of hypercorn's worker among the children of ``pid`` (the other
    one is Python's multiprocessing resource tracker)."""
    table = subprocess.run(
        ["ps", "-A", "-ww", "-o", "pid=,ppid=,command="], capture_output=True, text=True, check=True
    ).stdout
    workers = [
        int(child)
        for child, parent, command in (line.split(None, 2) for line in table.splitlines())
        if int(parent) == pid and "spawn_main" in command
    ]
    assert len(workers) == 1, table
    return workers[0]


def test_settings_precedence_env_then_flags() -> None:
    args = build_parser().parse_args(["serve", "--capacity", "3", "--alias", "claude-*=x"])
    env = {"MLXTRIO_CAPACITY": "7", "MLXTRIO_WAITING_ROOM": "2", "MLXTRIO_PORT": "9000"}
    os.environ.update(env)
    try:
        settings = settings_from_args(args)
    finally:
        for key in env:
            del os.environ[key]
    assert settings.capacity == 3  # flag wins
    assert settings.waiting_room == 2  # env
    assert settings.port == 9000
    assert settings.aliases == {"claude-*": "x"}
    assert Settings().host == "127.0.0.1" and Settings().port == 8000


def test_bad_settings_are_reported_by_name() -> None:
    for env, word in (
        ({"MLXTRIO_CAPACITY": "-1"}, "capacity"),
        ({"MLXTRIO_PORT": "abc"}, "MLXTRIO_PORT"),
        ({"MLXTRIO_ALIASES": "nonsense"}, "aliases"),
        ({"MLXTRIO_COMPUTE_DTYPE": "fp8"}, "compute_dtype"),
        ({"MLXTRIO_SHARDING": "data"}, "sharding"),
        ({"MLXTRIO_RANK_TIMEOUT": "0"}, "rank_timeout"),
    ):
        try:
            Settings.from_env(environ=env)
        except SettingsError as exc:
            assert word in str(exc)
        else:
            raise AssertionError(f"{env} was accepted")


def test_every_setting_has_a_working_flag() -> None:
    """Each Settings field is reachable from `mlxtrio serve --flag` (regression:
    a flag that parsed but never reached the settings)."""
    import dataclasses

    samples = {int: "7", float: "7.5", str: "x"}
    for field in dataclasses.fields(Settings):
        flag = "--" + field.name.replace("_", "-")
        if field.name in ("extra_models", "aliases"):
            continue  # repeatable flags, covered above
        if field.name == "pinned_models":  # comma-separated lists and maps
            args = build_parser().parse_args(["serve", flag, "a, b"])
            assert settings_from_args(args).pinned_models == ("a", "b")
            continue
        if field.name == "model_keep_alive":
            args = build_parser().parse_args(["serve", flag, "a=5,b=0"])
            assert settings_from_args(args).model_keep_alive == {"a": "5", "b": "0"}
            continue
        if str(field.type) == "bool":
            for text, expected in (("on", True), ("0", False), ("true", True)):
                args = build_parser().parse_args(["serve", flag, text])
                assert getattr(settings_from_args(args), field.name) is expected, field.name
            continue
        kind = {"int": int, "float": float, "str": str}[str(field.type)]
        value = samples[kind]
        if field.name == "port":
            value = "9123"
        if field.name == "response_retention":
            value = "3600"
        if field.name == "database_url":
            value = "none"
        if field.name == "compute_dtype":
            value = "float32"
        if field.name == "sharding":
            value = "tensor"
        if field.name == "speculation":
            value = "off"
        args = build_parser().parse_args(["serve", flag, value])
        settings = settings_from_args(args)
        assert str(getattr(settings, field.name)) == str(kind(value)), field.name


def test_auto_capacity_follows_the_kv_the_machine_can_hold() -> None:
    from mlxtrio.engine.sizing import auto_capacity

    qwen3_8b = {
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4096,
    }
    assert auto_capacity(qwen3_8b, "bfloat16", 64 << 30) == 14
    assert auto_capacity(qwen3_8b, "bfloat16", 16 << 30) == 4  # never below 4
    assert (
        auto_capacity(
            {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256},
            "float32",
            8 << 30,
        )
        == 16
    )
    assert auto_capacity({}, "float32", 8 << 30) == 8  # a config that does not say


async def test_auto_capacity_sizes_the_batch_and_the_lane(server_factory) -> None:
    server = await server_factory()  # the embedded model, CAPACITY auto
    assert server.engine.capacity == 16
    assert server.services.lanes[server.engine.name].capacity == 16
    async with server.client() as client:
        health = (await client.get("/health")).json()
    assert health["models"][0]["capacity"] == 16
