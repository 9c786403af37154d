"""An engine's states, and what happens when its thread ends: the restart
policy for a thread that died, and the failure of a world of ranks.

Runs on the Trio thread (the engine thread's end is posted there).

* A thread that ended cleanly (shutdown) ends every open handle, cancelled.
* A thread that died while loading fails the engine for good (``/health``
  says why).
* A thread that died while serving is restarted on the weights already
  loaded (``restarting``), after a backoff; a crash loop gives up after
  :data:`MAX_RESTARTS` deaths within :data:`RESTART_WINDOW` seconds.
* Across ranks nothing is restarted: one rank's thread cannot be, so a dead
  thread, or a lock-step round that no rank answers within ``rank_timeout``
  seconds, fails the world and the server shuts down.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Protocol

import trio

from .distributed.lockstep import LeaderSchedule
from .distributed.world import World

log = logging.getLogger("mlxtrio.engine")

MAX_RESTARTS = 3
RESTART_WINDOW = 60.0  # seconds
RESTART_BACKOFF = 0.1  # seconds before the first restart; x4 for each next one


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Supervised(Protocol):
    """What the supervisor reads and changes of its engine."""

    name: str
    world: World
    state: EngineState
    error: str | None
    restarts: int

    @property
    def loaded_model(self) -> bool: ...
    @property
    def leader(self) -> LeaderSchedule | None: ...

    def end_all_handles(self, error: str | None) -> None: ...
    def start_thread(self, delay: float) -> None: ...
    def mark_settled(self) -> None: ...


class Supervisor:
    """Decides what an ended engine thread means, for ``engine``."""

    def __init__(self, engine: Supervised, rank_timeout: float) -> None:
        self._engine = engine
        self.rank_timeout = rank_timeout
        self._crashes: list[float] = []
        self.world_failed = trio.Event()

    def thread_ended(self, error: str | None) -> None:
        """The engine thread ended: cleanly (``error`` None), failing to load,
        or dying while it served."""
        engine = self._engine
        if error is None:
            engine.end_all_handles(None)
            return
        if engine.world.distributed:
            what = "failed" if engine.loaded_model else "could not open the model on every rank"
            self.fail_world(f"the distributed engine {what}: {error}")
            return
        engine.error = error
        engine.end_all_handles(f"the engine failed: {error}")
        if not engine.loaded_model or engine.state in (EngineState.STOPPING, EngineState.STOPPED):
            engine.state = EngineState.STOPPED if engine.loaded_model else EngineState.FAILED
            engine.mark_settled()
            return
        delay = self._restart_delay()
        if delay is None:
            engine.state = EngineState.FAILED
            engine.error = (
                f"the engine thread died {len(self._crashes)} times within "
                f"{RESTART_WINDOW:.0f} s; giving up (last error: {error})"
            )
            log.error("model %s: %s", engine.name, engine.error)
            return
        engine.restarts += 1
        engine.state = EngineState.RESTARTING
        log.warning(
            "model %s: restarting the engine thread in %.1f s after: %s", engine.name, delay, error
        )
        engine.start_thread(delay)

    def _restart_delay(self) -> float | None:
        """Seconds to wait before restarting after a death now; None: give up."""
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < RESTART_WINDOW] + [now]
        if len(self._crashes) > MAX_RESTARTS:
            return None
        return RESTART_BACKOFF * 4 ** (len(self._crashes) - 1)

    async def watch_ranks(self) -> None:
        """Return when the distributed world has failed (never in a world of
        one): the engine thread died (a rank left: its connections closed), or
        no round completed for ``rank_timeout`` seconds (a rank stopped
        answering; the engine thread stays blocked in a collective and is
        abandoned at shutdown). Either way the engine is failed first: every
        open handle ends with an error and ``/health`` says 503.
        Cancellation: stops watching, nothing else."""
        engine = self._engine
        if not engine.world.distributed:
            await trio.sleep_forever()
        while not self.world_failed.is_set():
            with trio.move_on_after(1.0):
                await self.world_failed.wait()
            leader = engine.leader
            if leader is None or engine.state not in (EngineState.READY, EngineState.STOPPING):
                continue
            silent = time.monotonic() - leader.last_round
            if silent > self.rank_timeout:
                self.fail_world(
                    f"no answer from the other ranks for {silent:.0f} s "
                    f"(rank_timeout {self.rank_timeout:g} s): a rank stopped responding"
                )

    def fail_world(self, reason: str) -> None:
        """Fail a distributed engine for good (once)."""
        if self.world_failed.is_set():
            return
        engine = self._engine
        engine.state = EngineState.FAILED
        engine.error = reason
        log.error(
            "model %s across %d ranks: %s; shutting down", engine.name, engine.world.size, reason
        )
        engine.end_all_handles(f"the engine failed: {reason}")
        engine.mark_settled()
        self.world_failed.set()
