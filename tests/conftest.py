"""Test harness: the real server (hypercorn's trio worker serving ``create_app``)
inside the test's nursery on an ephemeral port, the real engine on the embedded
model, driven over real sockets."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from mlxtrio.app import MlxtrioApp, create_app
from mlxtrio.engine.engine import Engine, EngineState
from mlxtrio.serving.services import Services
from mlxtrio.settings import Settings


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process here, its results reported: the session leaves
    pooled engine threads (daemons) behind, and C++ teardown at interpreter
    exit racing one of them inside MLX can abort the process (seen once, a
    whole run passed: "terminate called without an active exception")."""
    status = getattr(config, "_mlxtrio_exit_status", None)
    if status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._mlxtrio_exit_status = int(exitstatus)  # type: ignore[attr-defined]


MODEL = "mlxtrio-tiny"
SCRIPTED = "scripted"


@dataclass
class Server:
    url: str
    host: str
    port: int
    app: MlxtrioApp

    @property
    def services(self) -> Services:
        return self.app.extensions["mlxtrio"]

    @property
    def engine(self) -> Engine:
        engine = self.services.models.default.engine
        assert engine is not None, "the main model is not loaded"
        return engine

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=60, **kwargs)

    def openai(self) -> openai.AsyncOpenAI:
        """The official openai SDK (Responses, Chat Completions) on this server."""
        return openai_client(self.url)

    def anthropic(self) -> anthropic.AsyncAnthropic:
        """The official anthropic SDK (Messages) on this server."""
        return anthropic_client(self.url)


def openai_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def anthropic_client(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


async def start_server(nursery: trio.Nursery, **overrides: Any) -> Server:
    if "data_dir" not in overrides:
        overrides["data_dir"] = tempfile.mkdtemp(prefix="mlxtrio-test-")
    settings = Settings.from_env(environ={}, port=8000, **overrides)
    app = create_app(settings)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1
    binds = await nursery.start(serve, app, config)
    default = app.extensions["mlxtrio"].models.default
    with trio.fail_after(60):
        while default.engine is None or default.engine.state is EngineState.LOADING:
            await trio.sleep(0.01)
    url = binds[0]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return Server(url, host, int(port), app)


ServerFactory = Callable[..., Any]


@pytest.fixture
async def server_factory(nursery: trio.Nursery) -> AsyncIterator[ServerFactory]:
    async def factory(**overrides: Any) -> Server:
        return await start_server(nursery, **overrides)

    yield factory


@pytest.fixture
async def server(server_factory: ServerFactory) -> Server:
    """The server on the embedded model."""
    return await server_factory()


@pytest.fixture(scope="session")
def scripted_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from .scripted_model import build

    return str(build(tmp_path_factory.mktemp("scripted-model")))


@pytest.fixture
async def scripted(server_factory: ServerFactory, scripted_model_path: str) -> Server:
    """The server on the scripted model (exactly known greedy output)."""
    return await server_factory(model=scripted_model_path, model_name=SCRIPTED)


@pytest.fixture(scope="session")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """Tool-call family name -> its scripted model's path (see
    ``tests/scripted_families.py``), built on first use."""
    from .scripted_families import build_family

    built: dict[str, str] = {}

    def path(name: str) -> str:
        if name not in built:
            built[name] = str(build_family(tmp_path_factory.mktemp(name), name))
        return built[name]

    return path


def free_port() -> int:
    """A TCP port nothing listens on now (for servers started as processes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive TCP ports nothing listens on now
    (mlx.launch's ring backend takes ``--starting-port`` and the ones after
    it). Drawn below Linux's ephemeral range, where the test's own client
    connections cannot be holding the neighbours."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 30000 - count)
        probes = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports")


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition on the server's state; fail the test on timeout."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.005)
        return
    raise AssertionError(f"timed out waiting for {what or predicate}")


def parse_sse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """Frames with ``event:`` and JSON ``data:`` lines; comments skipped."""
    events = []
    for block in raw.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
        if name is not None and data is not None:
            events.append((name, data))
    return events


class RawConnection:
    """A bare HTTP/1.1 client over a trio socket, for hanging up at exact moments."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.received = b""

    @classmethod
    async def open(cls, server: Server) -> RawConnection:
        return cls(await trio.open_tcp_stream(server.host, server.port))

    async def post_json(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        payload = json.dumps(body).encode()
        lines = [
            f"POST {path} HTTP/1.1",
            "Host: 127.0.0.1",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        await self.stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)

    async def read_until(self, marker: bytes, timeout: float = 30) -> bytes:
        with trio.fail_after(timeout):
            while marker not in self.received:
                chunk = await self.stream.receive_some(65536)
                if not chunk:
                    break
                self.received += chunk
        return self.received

    async def close(self) -> None:
        await self.stream.aclose()
