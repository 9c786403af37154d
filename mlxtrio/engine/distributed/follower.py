"""A rank other than 0: its shard of the model, stepped in lock step with rank 0
until rank 0 ends the world. It serves nothing itself.

The engine loop runs on its own thread, as on rank 0, with rank 0's commands
(:class:`~.lockstep.FollowerSchedule`); the main thread watches it and decides
how the process ends:

* rank 0 shuts the world down (its server stopped): exit 0;
* a collective fails (rank 0 or another rank is gone: their connections
  closed) or the model cannot be opened: one log line, exit 1;
* no round for rank 0's ``rank_timeout``: a rank stopped answering and the
  loop is blocked in a collective that will not return; one log line, exit 1
  (the engine thread is a daemon and is abandoned);
* SIGINT or SIGTERM: under ``mlx.launch`` a Ctrl-C reaches every rank, and
  rank 0 then finishes its streams and shuts the world down; this rank waits
  for that, for twice rank 0's shutdown grace plus :data:`SIGNAL_MARGIN`, and
  exits 1 if it does not come. A second signal exits at once.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from functools import partial
from types import FrameType
from typing import Any

from ..cache.snapshots import KVTiers
from ..handle import GenerationHandle
from ..loop import EngineLoop
from ..outbox import HandleEvent
from ..processors.grammar_masks import compile_grammar
from ..types import EngineStats, Entry, Match
from .lockstep import FollowerSchedule
from .ranks import RankPlan, open_ranks
from .world import Link, World

log = logging.getLogger("mlxtrio.engine")

EXIT_OK, EXIT_FAILED = 0, 1
# Rank 0's shutdown takes its grace twice (the engines drain, then hypercorn
# closes connections) plus the stores' write timeout: wait that long and more.
SIGNAL_MARGIN = 30.0  # seconds past twice rank 0's shutdown grace
WATCH_INTERVAL = 0.5  # seconds


def serve_follower(world: World) -> int:
    """Run this rank until the world ends; returns the process's exit status.
    Must run on the main thread (signal handling)."""
    rank = _Rank(world)
    thread = threading.Thread(
        target=rank.run, name=f"mlxtrio-engine-rank-{world.rank}", daemon=True
    )
    signalled: list[float] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signalled.append(time.monotonic())
        if len(signalled) == 1 and rank.plan is not None:
            log.info("%s: waiting for rank 0 to end the world", signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_INTERVAL)
            status = _watch(rank, signalled)
            if status is not None:
                return status
        return rank.status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _watch(rank: _Rank, signalled: list[float]) -> int | None:
    """The exit status to leave with now, or None to keep going."""
    plan, schedule = rank.plan, rank.schedule
    if signalled and (plan is None or len(signalled) > 1):
        log.info("rank %d: stopping", rank.world.rank)
        return EXIT_FAILED
    if signalled and plan is not None:
        waited = time.monotonic() - signalled[0]
        if waited > 2 * plan.shutdown_grace + SIGNAL_MARGIN:
            log.error(
                "rank %d: rank 0 did not end the world in %.0f s; exiting", rank.world.rank, waited
            )
            return EXIT_FAILED
    if schedule is not None and plan is not None:
        silent = time.monotonic() - schedule.last_round
        if silent > plan.rank_timeout:
            log.error(
                "rank %d: no round from rank 0 for %.0f s (rank_timeout %g s): "
                "a rank stopped responding; exiting",
                rank.world.rank,
                silent,
                plan.rank_timeout,
            )
            return EXIT_FAILED
    return None


class _Rank:
    """The engine thread's work on this rank."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.plan: RankPlan | None = None
        self.schedule: FollowerSchedule | None = None
        self.status = EXIT_FAILED

    def run(self) -> None:
        try:
            link = Link(self.world)
            opened = open_ranks(link)
            self.plan, loaded = opened.plan, opened.loaded
            grammars = _grammar_compiler(loaded.grammar_tokenizer)
            schedule = FollowerSchedule(link, opened.doorbell, grammars)
            loop = EngineLoop(
                loaded,
                schedule,
                _Outbox(schedule),
                self.plan.loop,
                KVTiers(),
                EngineStats(),
                itertools.count().__next__,  # entry ids as rank 0 numbers them
                strict=True,
            )
            self.schedule = schedule
            log.info(
                "rank %d of %d: serving its shard of %s for rank 0",
                self.world.rank,
                self.world.size,
                self.plan.name,
            )
            loop.run()
            log.info("rank %d: rank 0 ended the world", self.world.rank)
            self.status = EXIT_OK
        except BaseException as exc:  # the process reports and ends, never hangs
            log.error(
                "rank %d: the distributed engine failed: %s: %s; exiting",
                self.world.rank,
                type(exc).__name__,
                exc,
            )


def _grammar_compiler(tokenizer: Any) -> Any:
    """Compile rank 0's grammars here (rank 0 only sends grammars when its
    tokenizer can be constrained, and every rank has the same tokenizer)."""
    if tokenizer is None:

        def refuse(source: str) -> Any:
            raise RuntimeError("rank 0 sent a grammar, but this rank cannot constrain its model")

        return refuse
    return partial(compile_grammar, tokenizer)


class _Outbox:
    """Nobody reads this rank's events: it only forgets ended sequences."""

    def __init__(self, schedule: FollowerSchedule) -> None:
        self._schedule = schedule

    def deliver(self, deliveries: list[HandleEvent]) -> None:
        for handle, event in deliveries:
            if event.finish_reason is not None or event.error is not None:
                self._schedule.ended(handle)

    def snapshot(self, entry: Entry) -> None:
        pass  # rank 0's prefix index decides what is kept and dropped

    def release(self, match: Match) -> None:
        pass

    def shared(self, handle: GenerationHandle) -> None:
        pass
