"""Graceful shutdown under plain ``hypercorn -k trio mlxtrio.app:app``.

``mlxtrio serve`` runs hypercorn with its own shutdown trigger, which drains the
engines (every stream gets its terminal event) before hypercorn closes any
connection. The hypercorn command line gives the app no such hook: on SIGTERM
its supervisor process tells the worker to stop, the worker gives open
connections ``--graceful-timeout`` seconds (3 by default) and then cuts them -
streams end with no terminal event - and only afterwards runs the app's
shutdown. So the app watches for the worker's own shutdown itself:

* hypercorn's trio worker keeps a ``WorkerContext`` whose ``terminated`` event
  is set the moment the shutdown starts (hypercorn offers no public accessor;
  it is a local of its ``worker_serve`` coroutine, the worker's main task);
* when it is set, the engines drain within the graceful timeout, less a margin
  for the terminal events to reach the clients;
* SIGTERM or SIGINT delivered to the worker process itself (systemd stops a
  whole control group) drain first and then end the worker through the
  context's ``terminate`` event, as hypercorn's ``--max-requests`` does.

Everything here is a no-op when the app runs under anything else (``mlxtrio
serve``, tests, another ASGI server).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from .engine.distributed.world import launched

log = logging.getLogger("mlxtrio")

# Time left for the cancelled streams' terminal events to reach their clients
# (the drain waits up to DRAIN_SETTLE of it for the engine to confirm).
DELIVERY_MARGIN = 1.5

Drain = Callable[[float], Awaitable[object]]


def hypercorn_worker() -> tuple[Any, Any] | None:
    """``(context, config)`` of the hypercorn trio worker running this app, or
    None when the app is not served by hypercorn's own trio worker loop."""
    try:
        from hypercorn.trio.run import worker_serve
    except ImportError:
        return None
    root = trio.lowlevel.current_root_task()
    for nursery in root.child_nurseries if root else ():
        for task in nursery.child_tasks:
            frame = getattr(task.coro, "cr_frame", None)
            if frame is not None and frame.f_code is worker_serve.__code__:
                names = frame.f_locals
                if "context" in names and "config" in names:
                    return names["context"], names["config"]
    return None


async def drain_with_hypercorn(drain: Drain, grace: float) -> None:
    """Run for the app's lifetime (in its nursery): drain the engines when
    hypercorn's worker starts shutting down, or when this process receives
    SIGTERM / SIGINT. Returns at once when not under hypercorn's trio worker."""
    worker = hypercorn_worker()
    if worker is None:
        return
    if launched():
        log.warning(
            "a distributed launcher started this process, but `hypercorn mlxtrio.app:app` "
            "serves the model in one process: run `python -m mlxtrio serve` under "
            "mlx.launch to shard it across the ranks"
        )
    context, config = worker
    budget = max(0.0, min(grace, float(config.graceful_timeout) - DELIVERY_MARGIN))
    async with trio.open_nursery() as nursery:
        if threading.current_thread() is threading.main_thread():
            nursery.start_soon(_on_signal, drain, budget, context)
        await context.terminated.wait()
        log.info("shutting down: finishing in-flight generations (up to %.1f s)", budget)
        await drain(budget)
        nursery.cancel_scope.cancel()


async def _on_signal(drain: Drain, budget: float, context: Any) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            log.info("%s: finishing in-flight generations (up to %.1f s)", name, budget)
            break
    await drain(budget)
    await context.terminate.set()


def exit_hypercorn(status: int) -> None:
    """Exit the process with ``status``, taking hypercorn's supervisor along.

    Under the ``hypercorn`` command, the app runs in a worker process that
    hypercorn's supervisor started; the supervisor ignores how its last worker
    exited and returns 0 (hypercorn 0.18 ``run``: the worker's exit code is
    replaced by that of an empty worker list). A start-up refusal would then
    look like success to a shell or a service manager, so the supervisor is
    ended by a signal it does not handle, which makes it exit non-zero.
    """
    parent = multiprocessing.parent_process()
    # A spawned worker has the supervisor's sys.argv: the `hypercorn` script,
    # or hypercorn/__main__.py under `python -m hypercorn`.
    launched_by_hypercorn = any(
        part.startswith("hypercorn") for part in Path(sys.argv[0]).parts[-2:]
    )
    # The parent must still be the supervisor that spawned this worker: once it
    # is gone the worker is re-parented (to init or a subreaper), and on Windows
    # a stale pid may name another process; the parent's sentinel knows.
    if (
        parent is not None
        and launched_by_hypercorn
        and parent.is_alive()
        and parent.pid == os.getppid()
    ):
        # SIGTERM on Windows, where os.kill means TerminateProcess.
        unhandled = getattr(signal, "SIGUSR1", signal.SIGTERM)
        with contextlib.suppress(OSError):
            os.kill(parent.pid, unhandled)
    os._exit(status)
