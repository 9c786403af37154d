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

A thread is back in the pool before :meth:`EngineThread.join` returns, so an
engine loaded after another's unload reuses its thread; a restart after a
crash runs on the crashed run's own thread (queued behind the run's last
steps), never on a new one. A run that never returns (a wedged MLX call) keeps
its thread: it is never handed to another engine. Pool threads are daemons,
so neither can keep the process alive.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_Inbox = queue.SimpleQueue["EngineThread"]


class EngineThread:
    """``target(*args)`` on a pooled thread, with the parts of
    :class:`threading.Thread`'s interface the engine uses. ``after``: the run
    this one replaces (a restart); it runs on the same thread, once that
    run has returned."""

    def __init__(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        name: str,
        after: EngineThread | None = None,
    ) -> None:
        self.name = name
        self._target: Callable[..., Any] | None = target
        self._args = args
        self._after = after
        self._inbox: _Inbox | None = None
        self._started = False
        self._done = threading.Event()

    def start(self) -> None:
        self._started = True
        prefer = self._after._inbox if self._after is not None else None
        self._after = None
        _POOL.run(self, prefer)

    def join(self, timeout: float | None = None) -> None:
        """Block until the run returns (and its thread is back in the pool),
        or ``timeout`` seconds pass."""
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return self._started and not self._done.is_set()

    def _run(self) -> None:
        target, args = self._target, self._args
        # Like threading.Thread: let go of the target (it holds the engine),
        # so an idle pool thread keeps nothing of the engine it ran.
        self._target, self._args = None, ()
        assert target is not None
        target(*args)


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Inbox] = []
        self.threads = 0  # started so far

    def run(self, job: EngineThread, prefer: _Inbox | None) -> None:
        with self._lock:
            if prefer is not None:
                # The replaced run's thread: idle now, or about to be (its
                # queue holds the job until the run has returned).
                if prefer in self._idle:
                    self._idle.remove(prefer)
                inbox = prefer
            elif self._idle:
                inbox = self._idle.pop()
            else:
                inbox = queue.SimpleQueue()
                self.threads += 1
                threading.Thread(target=self._serve, args=(inbox,), daemon=True).start()
            job._inbox = inbox
            # Under the lock: a thread finishing its run decides whether it
            # is idle by its queue being empty.
            inbox.put(job)

    def _serve(self, inbox: _Inbox) -> None:
        while True:
            job = inbox.get()
            threading.current_thread().name = job.name
            try:
                job._run()
            finally:
                threading.current_thread().name = "mlxtrio-engine-idle"
                with self._lock:
                    if inbox.empty():  # a restart may already wait in it
                        self._idle.append(inbox)
                job._done.set()
                del job


_POOL = _Pool()


def pool_size() -> int:
    """Threads the pool has started (engines that ran at once, at most)."""
    return _POOL.threads
