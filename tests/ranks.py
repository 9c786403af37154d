"""Start a model across local ranks: ``python -m mlxtrio serve`` once per rank,
on MLX's ring backend over loopback, as ``mlx.launch --backend ring --hosts
127.0.0.1`` does (each rank gets MLX_RANK and a hostfile naming every rank's
port). mlx.launch itself spins a core forwarding output (0.32: its select
loop waits on an always-writable stdin pipe), which a 2-core machine cannot
spare, so the tests start the ranks themselves; one test runs mlx.launch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from .conftest import free_port

PYTHON = sys.executable


@dataclass
class Ranks:
    """Local ranks serving one model; rank 0 serves HTTP on ``port``."""

    port: int
    procs: list[trio.Process]
    logs: list[Path]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=60)

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    async def health(self) -> httpx.Response:
        async with self.client() as client:
            return await client.get("/health")

    async def wait_ready(self, timeout: float = 120) -> dict[str, Any]:
        """Wait for /health 200; fails at once if a rank exits meanwhile."""
        with trio.fail_after(timeout):
            while True:
                for rank, proc in enumerate(self.procs):
                    if proc.returncode is not None:
                        raise AssertionError(f"rank {rank} exited:\n{self.log(rank)}")
                try:
                    r = await self.health()
                    if r.status_code == 200:
                        return dict(r.json())
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)

    async def wait_exit(self, rank: int, timeout: float = 30) -> int:
        with trio.fail_after(timeout):
            return await self.procs[rank].wait()


def hostfile(path: Path, ranks: int) -> Path:
    """A ring hostfile: one loopback address per rank, each on a free port."""
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
    return path


@asynccontextmanager
async def launch_ranks(tmp_path: Path, *args: str, ranks: int = 2, **env: str):
    """Yield :class:`Ranks` running ``mlxtrio serve *args``; every rank still
    running at the end is stopped (SIGTERM, then SIGKILL)."""
    port = free_port()
    hosts = hostfile(tmp_path / "hosts.json", ranks)
    base = {**os.environ, "MLX_HOSTFILE": str(hosts), "MLXTRIO_LOG_LEVEL": "info", **env}
    command = [PYTHON, "-m", "mlxtrio", "serve", "--port", str(port), *args]
    procs, logs = [], []
    try:
        for rank in range(ranks):
            logs.append(tmp_path / f"rank{rank}.log")
            with logs[-1].open("wb") as out:
                procs.append(
                    await trio.lowlevel.open_process(
                        command,
                        env={**base, "MLX_RANK": str(rank)},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        yield Ranks(port, procs, logs)
    finally:
        await stop_all(procs)


async def stop_all(procs: list[trio.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)  # a stopped rank takes no other signal
            proc.send_signal(signal.SIGTERM)
    with trio.move_on_after(20):
        for proc in procs:
            await proc.wait()
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
