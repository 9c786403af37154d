"""Helpers shared by the benchmarks: start a server process and wait for it."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_ready(url: str, path: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Poll ``url + path`` until it answers 200; fail if the process exits."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if client.get(url + path).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise RuntimeError("server did not become ready")
