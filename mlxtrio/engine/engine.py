"""The engine: one model, one dedicated thread, continuous batching.

Threading contract
------------------
* The engine thread owns every MLX object: weights, KV caches and mlx-lm's
  ``BatchGenerator`` (see :mod:`.loop`). Nothing else touches them.
* The Trio side talks to it through a command queue (:mod:`.commands`:
  submit, cancel, share, drop, forget-disk, shutdown); putting a command
  never blocks.
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
whose command the thread never read. What happens next is the
:mod:`.supervisor`'s to decide: the thread is restarted on the weights already
loaded (``/health`` says ``restarting``), or a crash loop gives up.

Across ranks
------------
In a distributed ``world`` (``mlx.launch``) this engine is rank 0's: its thread
opens the model on every rank (:mod:`.distributed.ranks`) and holds a lock-step
round with the other ranks at every safepoint (:mod:`.distributed.lockstep`).
A world cannot restart one rank's thread, so a thread that dies, or a round
that no rank answers within ``rank_timeout`` seconds, fails the engine for
good: :meth:`watch_ranks` returns, and the server shuts down.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import trio

from .cache.kv_store import KVStore
from .cache.prefix_cache import PrefixCache
from .commands import Cancel, Command, Shutdown, Submit
from .config import EngineConfig
from .distributed.lockstep import LeaderSchedule, RankState
from .distributed.ranks import RankPlan, open_ranks, resolved_capacity
from .distributed.world import SOLO, Link, World
from .handle import EngineError, EngineUnavailable, GenerationHandle, LiveHandles
from .image_tokens import KEY_BASE, VisionPrompt
from .loop import EngineLoop, LoopSettings
from .memory import release_buffers
from .model import LoadedModel, load_model
from .outbox import TrioOutbox
from .schedule import LocalSchedule, Schedule
from .sizing import MIN_CAPACITY
from .supervisor import EngineState, Supervisor
from .threads import EngineThread
from .types import EngineStats, GenerationStats, LoadProgress, Match, SamplingParams

log = logging.getLogger("mlxtrio.engine")

DRAIN_SETTLE = 1.0  # seconds cancelled sequences get to report, after a drain's grace
# Seconds an unload waits for the engine thread: a healthy thread ends after
# its current step (a big prefill chunk on a loaded machine takes seconds); a
# wedged one is abandoned after this, and the next model gets a new thread.
UNLOAD_JOIN = 15.0


class Engine:
    """Serve one model from its own thread. Create, ``await start()``, ``submit()``."""

    def __init__(
        self, name: str, path: str, config: EngineConfig | None = None, world: World = SOLO
    ) -> None:
        config = config or EngineConfig()
        self.name = name
        self.path = path
        self.world = world
        self.settings = config
        # 0 = auto: known once the model is loaded (see .sizing).
        self.capacity = config.capacity or MIN_CAPACITY
        self._loop_settings = LoopSettings(
            capacity=config.capacity,
            max_prefill_chunk=config.prefill_chunk,
            prefill_step_seconds=config.prefill_step_seconds,
            default_max_tokens=config.default_max_tokens,
            cache_enabled=config.prefix_cache_bytes > 0,
            speculation=config.speculation,
        )
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.stats = EngineStats()
        self.restarts = 0
        self.loaded: LoadedModel | None = None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._serials = itertools.count(1)
        self._thread: EngineThread | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._ready = trio.Event()
        self._live = LiveHandles()  # submitted, not yet terminated
        self.supervisor = Supervisor(self, config.rank_timeout)
        self.load_progress = LoadProgress()
        self._unloading = False
        # Each rank holds its own shard of every block, and rank 0 reads blocks
        # from disk before a request starts: the others could not.
        disk_bytes = 0 if world.distributed else config.prefix_cache_disk_bytes
        self.cache = PrefixCache(
            config.prefix_cache_bytes,
            disk_bytes,
            config.cache_dir,
            self._commands.put,
            self._live,
            self.stats,
        )
        self._entry_ids = itertools.count()
        # Across ranks: rank 0's schedule (its rounds), every rank's pid.
        self.leader: LeaderSchedule | None = None
        self.rank_pids: tuple[int, ...] = ()
        # Called on the Trio thread once the model is loaded, before the first
        # request can reach it (what depends on the loaded model's capacity).
        self.on_loaded: list[Callable[[Engine], None]] = []

    # ------------------------------------------------------------------
    # What the request path reads (Trio side)

    @property
    def tokenizer(self) -> Any:
        """The loaded model's tokenizer (mlx-lm's wrapper; safe to render
        with off the engine thread); None before the model is loaded."""
        return self.loaded.tokenizer if self.loaded else None

    @property
    def context_length(self) -> int:
        """The context served: the model's, or the configured limit if smaller."""
        own = self.loaded.context_length if self.loaded else 32768
        limit = self.settings.context_limit
        return min(own, limit) if limit > 0 else own

    @property
    def loaded_model(self) -> bool:
        return self.loaded is not None

    @property
    def active_sequences(self) -> int:
        """Sequences submitted and not yet finished (as the Trio side sees them)."""
        return len(self._live)

    @property
    def ranks(self) -> tuple[RankState, ...]:
        """Every rank's state as of the latest round (empty in a world of one)."""
        return self.leader.ranks if self.leader is not None else ()

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
        self.start_thread()

    def start_thread(self, delay: float = 0.0) -> None:
        """Start (or restart, after ``delay`` seconds) the engine thread."""
        # A pooled thread, not a new one: see .threads for why.
        self._thread = EngineThread(
            self._thread_main, (delay,), f"mlxtrio-engine-{self.name}", after=self._thread
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
            await self._live.wait_idle()
        for handle in self._live:
            handle.cancel()
        with trio.move_on_after(DRAIN_SETTLE):
            await self._live.wait_idle()

    async def stop(self, grace: float, unload: bool = False) -> None:
        """:meth:`drain`, then join the engine thread. Every handle still open
        afterwards gets its terminal event here. With ``unload`` the thread
        lets go of the model's weights and in-memory KV as it ends, and gives
        the memory back to the system (the engine cannot serve again); the
        join then waits up to :data:`UNLOAD_JOIN` seconds, because the next
        model loads into that memory and onto that thread.

        Safe to call more than once, and on an engine that failed to load.
        """
        if self._thread is None:
            return
        await self.drain(grace)
        self._unloading = unload
        self._commands.put(Shutdown())
        thread = self._thread
        # A failed world's thread may be blocked in a collective for good.
        failed = self.supervisor.world_failed.is_set()
        wait = 0.5 if failed else max(grace, UNLOAD_JOIN if unload else 1.0)
        with trio.move_on_after(wait):
            await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        if thread.is_alive():
            log.warning("engine thread for %s did not stop in time; abandoning it", self.name)
        writer = self.cache.kv.disk
        if writer is not None and not thread.is_alive():  # spills queued so far get written
            with trio.move_on_after(max(grace, 1.0)):
                await trio.to_thread.run_sync(writer.close, abandon_on_cancel=True)
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED
        self.end_all_handles(None)

    # ------------------------------------------------------------------
    # Requests (Trio side)

    async def lookup(
        self, prompt: list[int], domain: str = "", vision: VisionPrompt | None = None
    ) -> Match | None:
        """The longest cached prefix of ``prompt`` in isolation ``domain``, pinned
        until :meth:`release` (or until a sequence submitted with it starts).
        Callers know the reuse before sending headers. May wait for a running
        sequence's KV and read blocks from disk (see :class:`.cache.reuse.PrefixReuse`);
        cancelling it leaves nothing pinned. A prefix never ends inside one of
        ``vision``'s images (an image is encoded whole): one that would, ends
        where that image starts."""
        if self.loaded is not None and self.loaded.serial:
            return None  # nothing is kept for it to find (see .serial)
        key = (self.name, domain)
        match = await self.cache.lookup(self.loaded, key, prompt)
        cut = vision.inside(match.length) if vision is not None and match is not None else None
        if cut is None or match is None:
            return match
        if self.loaded is not None and self.loaded.plain_kv:
            # Built as found (whole blocks), then trimmed to the image's start.
            match.extent, match.length = match.extent or match.length, cut.start
            return match
        self.cache.release(match)
        # One token past the start: a lookup leaves its last token to the model,
        # so this matches up to the image start, a snapshot there included.
        return await self.cache.lookup(self.loaded, key, prompt[: cut.start + 1])

    def release(self, match: Match | None) -> None:
        """Unpin a match from :meth:`lookup`; idempotent."""
        self.cache.release(match)

    def submit(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        match: Match | None = None,
        domain: str = "",
        boundary: int = 0,
        vision: VisionPrompt | None = None,
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
        sees = self.loaded is not None and self.loaded.images is not None
        if sees and vision is None and max(prompt) >= KEY_BASE:
            # Key tokens name images in the prefix cache (only a model that
            # sees images is given them); no model has them.
            raise EngineError("a prompt with images' key tokens came without its images")
        handle = GenerationHandle(
            prompt, sampling, self._request_cancel, (self.name, domain), match
        )
        handle.boundary = boundary
        handle.vision = vision
        handle.serial = next(self._serials)
        self._live.add(handle)
        self._commands.put(Submit(handle))
        return handle

    def _request_cancel(self, handle: GenerationHandle) -> None:
        handle.cancel_requested_at_step = self.stats.steps
        self._commands.put(Cancel(handle))

    # ------------------------------------------------------------------
    # Called on the Trio thread by the engine thread (see .outbox)

    def _on_serving(self) -> None:
        if self.state is EngineState.LOADING:
            for hook in self.on_loaded:
                hook(self)
        if self.state in (EngineState.LOADING, EngineState.RESTARTING):
            self.state = EngineState.READY
            self.error = None
        self._ready.set()

    def _on_thread_exit(self, error: str | None) -> None:
        self.supervisor.thread_ended(error)

    def mark_settled(self) -> None:
        """Wake whoever waits for the engine to be ready: it will not be."""
        self._ready.set()

    async def watch_ranks(self) -> None:
        """Return when the distributed world has failed (see
        :meth:`.supervisor.Supervisor.watch_ranks`)."""
        await self.supervisor.watch_ranks()

    def end_all_handles(self, error: str | None) -> None:
        """Give every open handle its terminal event: ``error``, or cancelled."""
        self._live.end_all(error)

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
                self.load_progress.started = time.monotonic()
                self.loaded = load_model(
                    self.name, self.path, self.settings.compute_dtype, progress=self.load_progress
                )
                self.cache.open_disk(self.loaded, f"{self.path} ({self.loaded.dtype})", self._post)
                self._size_batch(resolved_capacity(self._loop_settings.capacity, self.loaded))
            assert self.loaded is not None
            loop = EngineLoop(
                self.loaded,
                schedule,
                TrioOutbox(self._post, self._live, self.cache.index),
                self._loop_settings,
                self.cache.kv,
                self.stats,
                lambda: next(self._entry_ids),
                strict=self.world.distributed,
            )
            self._post(self._on_serving)
            loop.run()
            del loop  # it holds the model and the batch's buffers
            if self._unloading:
                self._free_model()
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

    def _free_model(self) -> None:
        """Unloading (engine thread, the loop over): let go of the weights and
        the prefix cache's KV in memory (the disk tier stays, so a reload
        starts warm), and give the memory back to the system."""
        self.loaded = None
        self.cache.kv.memory = KVStore()
        gc.collect()
        self.stats.mlx_active_bytes = release_buffers()
        log.info("model %s unloaded", self.name)

    def _size_batch(self, capacity: int) -> None:
        """Set the batch size (engine thread, before serving: the Trio side
        reads ``capacity`` once the engine is ready)."""
        if self.loaded is not None and self.loaded.serial:
            log.info("model %s: one sequence at a time, %d admitted", self.name, capacity)
        else:
            log.info("model %s: decodes up to %d sequences at once", self.name, capacity)
        self.capacity = self._loop_settings.capacity = capacity

    def _open_ranks(self) -> LeaderSchedule:
        """Open the model on every rank (engine thread; see :mod:`.distributed.ranks`)."""
        link = Link(self.world)
        plan = RankPlan.for_leader(self.name, self.path, self.settings, self._loop_settings)
        opened = open_ranks(link, plan)
        self.loaded, self.rank_pids = opened.loaded, opened.pids
        self._size_batch(opened.plan.loop.capacity)
        self.leader = LeaderSchedule(self._commands, link, opened.doorbell)
        return self.leader


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineState",
    "EngineUnavailable",
    "GenerationHandle",
    "GenerationStats",
]
