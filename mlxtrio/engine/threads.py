"""Engine threads that outlive the engines they run.

MLX (0.32) gives every OS thread that computes streams of its own - the
default stream, and mlx-lm's thread-local generation stream - each with a
native worker thread and buffers, and keeps them after the thread ends. A
server that started a new thread for every model load grew by a thread and
~12 MiB of resident memory per switch (``benchmarks/model_switch.py``). So an
engine's thread is a :class:`EngineThread`: one run of the engine's main
function on a thread taken from a process-wide pool, given back when the run
returns (an unload, a shutdown, a crash before a restart). The pool holds as
many threads as engines ever ran at once.

A run that never returns (a wedged MLX call) keeps its thread: it is never
handed to another engine. Pool threads are daemons, so neither can keep the
process alive.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class EngineThread:
    """``target(*args)`` on a pooled thread, with the parts of
    :class:`threading.Thread`'s interface the engine uses."""

    def __init__(self, target: Callable[..., Any], args: tuple[Any, ...], name: str) -> None:
        self.name = name
        self._target = target
        self._args = args
        self._started = False
        self._done = threading.Event()

    def start(self) -> None:
        self._started = True
        _POOL.run(self)

    def join(self, timeout: float | None = None) -> None:
        """Block until the run returns, or ``timeout`` seconds pass."""
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return self._started and not self._done.is_set()

    def _run(self) -> None:
        try:
            self._target(*self._args)
        finally:
            self._done.set()


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[EngineThread]] = []
        self.threads = 0  # started, for tests and /health-style checks

    def run(self, job: EngineThread) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                inbox = queue.SimpleQueue()
                self.threads += 1
                worker = threading.Thread(target=self._serve, args=(inbox,), daemon=True)
                worker.start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue[EngineThread]) -> None:
        while True:
            job = inbox.get()
            threading.current_thread().name = job.name
            job._run()
            threading.current_thread().name = "mlxtrio-engine-idle"
            with self._lock:
                self._idle.append(inbox)


_POOL = _Pool()


def pool_size() -> int:
    """Threads the pool has started (engines that ran at once, at most)."""
    return _POOL.threads
