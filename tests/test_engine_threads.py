"""The engine thread pool (``mlxtrio.engine.threads``): a run's thread serves
the next run once it is back in the pool, a restart runs on the replaced run's
own thread, and an idle thread keeps nothing of the run it served."""

from __future__ import annotations

import gc
import threading
import weakref

from mlxtrio.engine.threads import EngineThread, pool_size


def run_on_pool(target, *args):  # type: ignore[no-untyped-def]
    run = EngineThread(target, args, "test-run")
    run.start()
    return run


def test_a_thread_back_in_the_pool_serves_the_next_run() -> None:
    idents: list[int] = []
    first = run_on_pool(lambda: idents.append(threading.get_ident()))
    first.join(5)
    assert not first.is_alive()
    started = pool_size()
    second = run_on_pool(lambda: idents.append(threading.get_ident()))
    second.join(5)
    assert idents[0] == idents[1] and pool_size() == started


def test_a_restart_runs_on_the_replaced_run_s_thread() -> None:
    """Even when it is started before the replaced run has returned (the
    engine posts its exit before its last lines run)."""
    idents: list[int] = []
    release = threading.Event()

    def crashing() -> None:
        idents.append(threading.get_ident())
        release.wait(5)

    first = run_on_pool(crashing)
    restart = EngineThread(lambda: idents.append(threading.get_ident()), (), "restart", after=first)
    started = pool_size()
    restart.start()
    release.set()
    restart.join(5)
    assert idents[0] == idents[1] and pool_size() == started


def test_an_idle_thread_keeps_nothing_of_its_run() -> None:
    class Engine:
        def main(self) -> None:
            pass

    engine = Engine()
    alive = weakref.ref(engine)
    run = run_on_pool(engine.main)
    run.join(5)
    del engine
    gc.collect()
    assert alive() is None
