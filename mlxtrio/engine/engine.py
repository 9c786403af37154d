"""The engine: one model, one dedicated thread, continuous batching.

Threading contract
------------------
* The engine thread owns every MLX object: weights, KV caches and mlx-lm's
  ``BatchGenerator`` (see :mod:`.loop`). Nothing else touches them.
* The Trio side talks to it through a command queue (``submit``, ``cancel``,
  ``drop``, ``shutdown``); putting a command never blocks.
* The engine talks back with one ``TrioToken.run_sync_soon`` per engine step,
  carrying every event that step produced (and one per prefix-cache snapshot
  taken or match released).
* The gap between two ``BatchGenerator.next()`` calls is the *safepoint*:
  pending commands are applied there. Each step's prefill is sized by time
  (``prefill_step_seconds``), so a cancelled sequence is dropped, and running
  streams get their next token, within about that long.

Terminal events
---------------
Every handle :meth:`Engine.submit` returns gets exactly one terminal event
(finished, cancelled or an error), however the engine fares: the Trio side keeps
every handle until its terminal event arrives, and when an engine thread dies it
ends all of them itself - including those submitted an instant before the death,
whose command the thread never read. The thread is then restarted on the weights
already loaded (``/health`` says ``restarting``); a crash loop gives up after
:data:`MAX_RESTARTS` deaths within :data:`RESTART_WINDOW` seconds.

Across ranks
------------
In a distributed ``world`` (``mlx.launch``) this engine is rank 0's: its thread
opens the model on every rank (:mod:`.ranks`) and holds a lock-step round with
the other ranks at every safepoint (:mod:`.lockstep`). A world cannot restart
one rank's thread, so a thread that dies, or a round that no rank answers
within ``rank_timeout`` seconds, fails the engine for good:
:meth:`watch_ranks` returns, and the server shuts down.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ..grammar.compiler import GrammarCompiler
from .commands import Cancel, Command, Drop, ForgetDisk, Share, Shutdown, Submit
from .disk_index import DiskIndex
from .handle import EngineError, EngineUnavailable, GenerationHandle
from .lockstep import LeaderSchedule, LocalSchedule, RankState, Schedule
from .loop import Delivery, EngineLoop, LoopSettings
from .model import LoadedModel, load_model
from .prefix_cache import Entry, Match, PrefixIndex
from .ranks import RankPlan, new_seed, open_ranks, resolved_capacity
from .reuse import PrefixReuse
from .sizing import MIN_CAPACITY
from .snapshots import KVTiers
from .types import EngineStats, GenerationEvent, GenerationStats, SamplingParams
from .world import SOLO, Link, World

log = logging.getLogger("mlxtrio.engine")

MAX_RESTARTS = 3
RESTART_WINDOW = 60.0  # seconds
RESTART_BACKOFF = 0.1  # seconds before the first restart; x4 for each next one
DRAIN_SETTLE = 1.0  # seconds cancelled sequences get to report, after a drain's grace


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Engine:
    """Serve one model from its own thread. Create, ``await start()``, ``submit()``."""

    def __init__(
        self,
        name: str,
        path: str,
        *,
        capacity: int,
        prefill_chunk: int,
        default_max_tokens: int,
        prefix_cache_bytes: int = 0,
        prefix_cache_disk_bytes: int = 0,
        cache_dir: Path | None = None,
        compute_dtype: str = "model",
        prefill_step_seconds: float = 0.25,
        context_limit: int = 0,
        world: World = SOLO,
        sharding: str = "auto",
        rank_timeout: float = 60.0,
        shutdown_grace: float = 5.0,
    ) -> None:
        self.name = name
        self.world = world
        self.sharding = sharding
        self.rank_timeout = rank_timeout
        self._shutdown_grace = shutdown_grace
        self._context_limit = context_limit
        self.path = path
        # 0 = auto: known once the model is loaded (see .sizing).
        self.capacity = capacity or MIN_CAPACITY
        self.compute_dtype_setting = compute_dtype
        self._loop_settings = LoopSettings(
            capacity=capacity,
            max_prefill_chunk=prefill_chunk,
            prefill_step_seconds=prefill_step_seconds,
            default_max_tokens=default_max_tokens,
            cache_enabled=prefix_cache_bytes > 0,
        )
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.stats = EngineStats()
        self.restarts = 0
        self.loaded: LoadedModel | None = None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._serials = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._ready = trio.Event()
        self._live_handles: set[GenerationHandle] = set()  # submitted, not yet terminated
        self._idle = trio.Event()
        self._idle.set()
        self._crashes: list[float] = []
        # Prefix cache: the indexes live on the Trio side, the KV on the engine
        # thread (it survives a restart of the thread) and in block files.
        disk = None
        if world.distributed:
            # Each rank holds its own shard of every block, and rank 0 reads
            # blocks from disk before a request starts: the others could not.
            prefix_cache_disk_bytes = 0
        if prefix_cache_bytes > 0 and prefix_cache_disk_bytes > 0 and cache_dir is not None:
            disk = DiskIndex(prefix_cache_disk_bytes, self._forget_disk_blocks)
        self.prefix_index = PrefixIndex(prefix_cache_bytes, self._drop_snapshots, disk)
        self.reuse = PrefixReuse(
            self.prefix_index, self._live_handles, self.stats, self._request_share
        )
        self._cache_dir = cache_dir
        self._kv = KVTiers()
        self._entry_ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        # Across ranks: rank 0's schedule (its rounds), every rank's pid.
        self._leader: LeaderSchedule | None = None
        self.rank_pids: tuple[int, ...] = ()
        self._world_failed = trio.Event()
        # Called on the Trio thread once the model is loaded, before the first
        # request can reach it (what depends on the loaded model's capacity).
        self.on_loaded: list[Callable[[Engine], None]] = []

    # ------------------------------------------------------------------
    # What the loaded model tells the request path

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer if self.loaded else None

    @property
    def config(self) -> dict[str, Any]:
        return self.loaded.config if self.loaded else {}

    @property
    def dtype(self) -> str | None:
        return self.loaded.dtype if self.loaded else None

    @property
    def load_seconds(self) -> float | None:
        return self.loaded.load_seconds if self.loaded else None

    @property
    def context_length(self) -> int:
        """The context served: the model's, or the configured limit if smaller."""
        own = self.loaded.context_length if self.loaded else 32768
        return min(own, self._context_limit) if self._context_limit > 0 else own

    @property
    def max_token_chars(self) -> int:
        return self.loaded.max_token_chars if self.loaded else 1

    @property
    def plain_kv(self) -> bool:
        """Whether the model's cache is plain attention KV (see LoadedModel)."""
        return self.loaded.plain_kv if self.loaded else True

    @property
    def tool_call_token(self) -> int | None:
        return self.loaded.tool_call_token if self.loaded else None

    @property
    def tool_call_end_token(self) -> int | None:
        return self.loaded.tool_call_end_token if self.loaded else None

    @property
    def grammars(self) -> GrammarCompiler | None:
        """The model's grammar compiler (None: it cannot be constrained)."""
        if self._grammars is None and self.loaded and self.loaded.grammar_tokenizer is not None:
            self._grammars = GrammarCompiler(self.loaded.grammar_tokenizer)
        return self._grammars

    @property
    def tool_call_mask_token(self) -> int | None:
        """The token masked to keep the model from opening a tool call."""
        return self.loaded.tool_call_mask_token if self.loaded else None

    @property
    def active_sequences(self) -> int:
        """Sequences submitted and not yet finished (as the Trio side sees them)."""
        return len(self._live_handles)

    @property
    def ranks(self) -> tuple[RankState, ...]:
        """Every rank's state as of the latest round (empty in a world of one)."""
        return self._leader.ranks if self._leader is not None else ()

    # ------------------------------------------------------------------
    # Lifecycle (Trio side)

    def launch(self) -> None:
        """Start the engine thread, which loads the model; returns at once.

        Must be called from the Trio thread. The thread is a daemon so that a
        wedged MLX call can never keep the process alive; :meth:`stop` joins it.
        """
        if self._thread is not None:
            return
        self._trio_token = trio.lowlevel.current_trio_token()
        self._start_thread()

    def _start_thread(self, delay: float = 0.0) -> None:
        self._thread = threading.Thread(
            target=self._thread_main,
            args=(delay,),
            name=f"mlxtrio-engine-{self.name}",
            daemon=True,
        )
        self._thread.start()

    async def wait_ready(self) -> None:
        """Wait until the model is loaded. Raises :class:`EngineError` if loading
        failed. Cancelling the wait does not stop the load (use :meth:`stop`)."""
        await self._ready.wait()
        if self.loaded is None:
            raise EngineError(f"model {self.name!r} failed to load: {self.error}")

    async def start(self) -> None:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        await self.wait_ready()

    async def drain(self, grace: float) -> None:
        """Refuse new work, give in-flight sequences ``grace`` seconds to finish,
        then cancel the rest (their consumers see ``finish_reason="cancelled"``,
        within one engine step; this waits at most :data:`DRAIN_SETTLE` more
        seconds for that)."""
        if self.state in (EngineState.READY, EngineState.RESTARTING):
            self.state = EngineState.STOPPING
        with trio.move_on_after(grace):
            await self._idle.wait()
        for handle in list(self._live_handles):
            handle.cancel()
        with trio.move_on_after(DRAIN_SETTLE):
            await self._idle.wait()

    async def stop(self, grace: float) -> None:
        """:meth:`drain`, then join the engine thread. Every handle still open
        afterwards gets its terminal event here.

        Safe to call more than once, and on an engine that failed to load.
        """
        if self._thread is None:
            return
        await self.drain(grace)
        self._commands.put(Shutdown())
        thread = self._thread
        # A failed world's thread may be blocked in a collective for good.
        wait = 0.5 if self._world_failed.is_set() else max(grace, 1.0)
        with trio.move_on_after(wait):
            await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        if thread.is_alive():
            log.warning("engine thread for %s did not stop in time; abandoning it", self.name)
        writer = self._kv.disk
        if writer is not None and not thread.is_alive():  # spills queued so far get written
            with trio.move_on_after(max(grace, 1.0)):
                await trio.to_thread.run_sync(writer.close, abandon_on_cancel=True)
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED
        self._end_all_handles(None)

    # ------------------------------------------------------------------
    # Requests (Trio side)

    async def lookup(self, prompt: list[int], domain: str = "") -> Match | None:
        """The longest cached prefix of ``prompt`` in isolation ``domain``, pinned
        until :meth:`release` (or until a sequence submitted with it starts).
        Callers know the reuse before sending headers. May wait for a running
        sequence's KV and read blocks from disk (see :class:`.reuse.PrefixReuse`);
        cancelling it leaves nothing pinned."""
        return await self.reuse.lookup(self.loaded, (self.name, domain), prompt)

    def release(self, match: Match | None) -> None:
        """Unpin a match from :meth:`lookup`; idempotent."""
        self.prefix_index.release(match)

    def submit(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        match: Match | None = None,
        domain: str = "",
        boundary: int = 0,
    ) -> GenerationHandle:
        """Queue a sequence for generation; returns at once.

        ``match`` (from :meth:`lookup` with the same prompt) makes it start from a
        cached prefix; the sequence's KV is cached under ``domain`` when it ends
        (and, for a cache that cannot be trimmed, also once prefilled up to
        ``boundary``, where the system prompt ends, and to the end of the
        conversation before the generation prompt).
        The returned handle must be used as an async context manager so that it is
        cancelled whatever way the caller leaves. Raises :class:`EngineError` if
        the engine is not serving (:class:`EngineUnavailable` while it loads,
        restarts or stops).
        """
        if self.state is not EngineState.READY:
            raise EngineUnavailable(f"model {self.name!r} is {self.state.value}")
        if not prompt:
            raise EngineError("empty prompt")
        handle = GenerationHandle(
            prompt, sampling, self._request_cancel, (self.name, domain), match
        )
        handle.boundary = boundary
        handle.serial = next(self._serials)
        self._live_handles.add(handle)
        if self._idle.is_set():
            self._idle = trio.Event()
        self._commands.put(Submit(handle))
        return handle

    def _request_cancel(self, handle: GenerationHandle) -> None:
        handle.cancel_requested_at_step = self.stats.steps
        self._commands.put(Cancel(handle))

    def _request_share(self, handle: GenerationHandle, at: int) -> None:
        self._commands.put(Share(handle, at))

    def _drop_snapshots(self, entry_ids: list[int]) -> None:
        self._commands.put(Drop(tuple(entry_ids)))

    def _forget_disk_blocks(self, names: list[bytes]) -> None:
        self._commands.put(ForgetDisk(tuple(names)))

    def _disk_written(self, name: bytes, size: int | None) -> None:
        """A block file was written (``size`` None: writing it failed)."""
        if self.prefix_index.disk is None:
            return
        if size is None:
            self._forget_disk_blocks([name])  # so the engine may spill it again
        else:
            self.prefix_index.disk.added([(name, size)])

    # ------------------------------------------------------------------
    # Called on the Trio thread by the engine thread (see _Outbox)

    def _deliver(self, deliveries: list[Delivery]) -> None:
        for handle, event in deliveries:
            handle._deliver(event)
            if handle.done:
                self._live_handles.discard(handle)
        if not self._live_handles:
            self._idle.set()

    def _on_serving(self) -> None:
        if self.state is EngineState.LOADING:
            for hook in self.on_loaded:
                hook(self)
        if self.state in (EngineState.LOADING, EngineState.RESTARTING):
            self.state = EngineState.READY
            self.error = None
        self._ready.set()

    def _on_thread_exit(self, error: str | None) -> None:
        """The engine thread ended: cleanly (shutdown), failing to load, or dying."""
        if error is None:
            self._end_all_handles(None)
            return
        if self.world.distributed:
            what = "could not open the model on every rank" if self.loaded is None else "failed"
            self._fail_world(f"the distributed engine {what}: {error}")
            return
        self.error = error
        self._end_all_handles(f"the engine failed: {error}")
        if self.loaded is None or self.state in (EngineState.STOPPING, EngineState.STOPPED):
            self.state = EngineState.FAILED if self.loaded is None else EngineState.STOPPED
            self._ready.set()
            return
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < RESTART_WINDOW] + [now]
        if len(self._crashes) > MAX_RESTARTS:
            self.state = EngineState.FAILED
            self.error = (
                f"the engine thread died {len(self._crashes)} times within "
                f"{RESTART_WINDOW:.0f} s; giving up (last error: {error})"
            )
            log.error("model %s: %s", self.name, self.error)
            return
        self.restarts += 1
        self.state = EngineState.RESTARTING
        delay = RESTART_BACKOFF * 4 ** (len(self._crashes) - 1)
        log.warning(
            "model %s: restarting the engine thread in %.1f s after: %s", self.name, delay, error
        )
        self._start_thread(delay)

    # ------------------------------------------------------------------
    # Across ranks (Trio side)

    async def watch_ranks(self) -> None:
        """Return when the distributed world has failed (never in a world of
        one): the engine thread died (a rank left: its connections closed), or
        no round completed for ``rank_timeout`` seconds (a rank stopped
        answering; the engine thread stays blocked in a collective and is
        abandoned at shutdown). Either way the engine is failed first: every
        open handle ends with an error and ``/health`` says 503."""
        if not self.world.distributed:
            await trio.sleep_forever()
        while not self._world_failed.is_set():
            with trio.move_on_after(1.0):
                await self._world_failed.wait()
            leader = self._leader
            if leader is None or self.state not in (EngineState.READY, EngineState.STOPPING):
                continue
            silent = time.monotonic() - leader.last_round
            if silent > self.rank_timeout:
                self._fail_world(
                    f"no answer from the other ranks for {silent:.0f} s "
                    f"(rank_timeout {self.rank_timeout:g} s): a rank stopped responding"
                )

    def _fail_world(self, reason: str) -> None:
        if self._world_failed.is_set():
            return
        self.state = EngineState.FAILED
        self.error = reason
        log.error("model %s across %d ranks: %s; shutting down", self.name, self.world.size, reason)
        self._end_all_handles(f"the engine failed: {reason}")
        self._ready.set()
        self._world_failed.set()

    def _end_all_handles(self, error: str | None) -> None:
        """Give every open handle its terminal event: ``error``, or cancelled."""
        for handle in list(self._live_handles):
            if error is None:
                event = GenerationEvent(finish_reason="cancelled", stats=handle.stats)
            else:
                event = GenerationEvent(error=error)
            handle._deliver(event)
        self._live_handles.clear()
        self._idle.set()

    def _post(self, fn: Any, *args: Any) -> None:
        """Hand ``fn(*args)`` to the Trio loop; dropped if the loop has ended."""
        assert self._trio_token is not None
        try:
            self._trio_token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    # ------------------------------------------------------------------
    # Engine thread

    def _thread_main(self, delay: float) -> None:
        """Load (first time only), then serve until shut down; a restarted
        thread first waits ``delay`` seconds (crash-loop backoff). Whatever
        happens, the Trio side hears about the end of this thread last, after
        every event the thread produced."""
        error: str | None = None
        try:
            time.sleep(delay)
            schedule: Schedule = LocalSchedule(self._commands)
            if self.world.distributed:
                schedule = self._open_ranks()
            elif self.loaded is None:
                self.loaded = load_model(self.name, self.path, self.compute_dtype_setting)
                self._open_disk_tier(self.loaded)
                self._size_batch(resolved_capacity(self._loop_settings.capacity, self.loaded))
            assert self.loaded is not None
            loop = EngineLoop(
                self.loaded,
                schedule,
                _Outbox(self),
                self._loop_settings,
                self._kv,
                self.stats,
                lambda: next(self._entry_ids),
                strict=self.world.distributed,
            )
            self._post(self._on_serving)
            loop.run()
        except BaseException as exc:  # the thread must report, never die silently
            error = f"{type(exc).__name__}: {exc}"
            if self.world.distributed:
                pass  # the Trio side says what failed, once (see _fail_world)
            elif self.loaded is None:
                log.error("cannot load model %s from %s: %s", self.name, self.path, error)
            else:
                log.exception("engine thread for %s died", self.name)
        finally:
            self._post(self._on_thread_exit, error)

    def _size_batch(self, capacity: int) -> None:
        """Set the batch size (engine thread, before serving: the Trio side
        reads ``capacity`` once the engine is ready)."""
        log.info("model %s: decodes up to %d sequences at once", self.name, capacity)
        self.capacity = self._loop_settings.capacity = capacity

    def _open_ranks(self) -> LeaderSchedule:
        """Open the model on every rank (engine thread; see :mod:`.ranks`)."""
        link = Link(self.world)
        plan = RankPlan(
            name=self.name,
            path=self.path,
            compute_dtype=self.compute_dtype_setting,
            sharding=self.sharding,
            loop=self._loop_settings,
            seed=new_seed(),
            rank_timeout=self.rank_timeout,
            shutdown_grace=self._shutdown_grace,
        )
        opened = open_ranks(link, plan)
        self.loaded, self.rank_pids = opened.loaded, opened.pids
        self._size_batch(opened.plan.loop.capacity)
        log.info(
            "model %s is sharded across %d ranks (pids %s)",
            self.name,
            self.world.size,
            ", ".join(map(str, opened.pids)),
        )
        self._leader = LeaderSchedule(self._commands, link, opened.doorbell)
        return self._leader

    def _open_disk_tier(self, loaded: LoadedModel) -> None:
        """Find the block files an earlier run left for these weights and start
        the writer (engine thread, before serving; a listing of the directory)."""
        if self.prefix_index.disk is None or self._cache_dir is None:
            return
        owner = f"{self.path} ({loaded.dtype})"
        written = partial(self._post, self._disk_written)
        found = self._kv.open_disk(self._cache_dir, loaded.fingerprint, owner, written)
        if found is not None:
            self.reuse.disk_dir = self._kv.directory
            self._post(self.prefix_index.disk.added, found)


class _Outbox:
    """The engine thread's way back to the Trio thread (see :class:`.loop.Outbox`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def deliver(self, deliveries: list[Delivery]) -> None:
        self._engine._post(self._engine._deliver, deliveries)

    def snapshot(self, entry: Entry) -> None:
        self._engine._post(self._engine.prefix_index.add, entry)

    def release(self, match: Match) -> None:
        self._engine._post(self._engine.prefix_index.release, match)

    def shared(self, handle: GenerationHandle) -> None:
        self._engine._post(handle.kv_ready.set)


__all__ = [
    "Engine",
    "EngineError",
    "EngineState",
    "EngineUnavailable",
    "GenerationHandle",
    "GenerationStats",
]
