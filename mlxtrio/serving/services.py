"""The server's long-lived parts, created once per app and started in its lifespan."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from .. import blas
from ..chat.sealing import ReasoningSealer
from ..engine.config import EngineConfig
from ..engine.distributed.world import SOLO, World
from ..engine.engine import Engine
from ..engine.sizing import MAX_CAPACITY
from ..metrics import Metrics
from ..settings import Settings
from ..store import ResponseStore, StoreError
from .admission import AdmissionLane
from .cache_watch import CacheWatch
from .catalog import ModelSpec, configured, discover
from .jobs import JobRegistry
from .memory import MemoryBudget, auto_limit, gib
from .residency import Residency, Resident

log = logging.getLogger("mlxtrio")
SEALING_KEY = "reasoning-seal"  # the shared secret's name in the store

STORE_RETRY = 30.0  # seconds between attempts to open a store that failed to open


def _size_lane(resident: Resident) -> None:
    """The model's lane admits as many as its batch holds (known once loaded)."""
    assert resident.engine is not None
    resident.lane.resize(resident.engine.capacity)


def _weights_estimate(spec: ModelSpec) -> int:
    """The memory a model's weights will take once loaded, before loading it:
    its files' size; twice that for half-precision weights that a CPU with a
    fast BLAS computes in float32 (see mlxtrio.engine.precision)."""
    if spec.upcast_on_cpu and blas.is_fast() and not _on_metal():
        return spec.size_bytes * 2
    return spec.size_bytes


def _on_metal() -> bool:
    import sys

    return sys.platform == "darwin"


@dataclass
class Services:
    settings: Settings
    world: World = SOLO
    models: Residency = field(init=False)
    render_lane: AdmissionLane = field(init=False)
    metrics: Metrics = field(init=False)
    memory: MemoryBudget = field(init=False)
    cache_watch: CacheWatch = field(init=False)
    sealer: ReasoningSealer = field(init=False)
    jobs: JobRegistry = field(default_factory=JobRegistry)  # background responses
    store: ResponseStore | None = None  # open and usable
    store_configured: bool = False  # a store is configured (it may not be open yet)
    started: bool = False
    # Set when the server cannot go on (a model served across ranks lost a
    # rank): `mlxtrio serve` then shuts down and exits non-zero.
    fatal: trio.Event = field(default_factory=trio.Event)
    _nursery: trio.Nursery | None = None

    def __post_init__(self) -> None:
        s = self.settings
        self.memory = MemoryBudget(s.memory_limit_bytes or auto_limit(), self._prefix_caches)
        config = EngineConfig.from_settings(s)
        specs = discover(s) if not self.world.distributed else _main_only(s)
        self.models = Residency(
            specs,
            default=s.served_model_name,
            # Claude Code names its models claude-*; unless configured otherwise
            # they all go to the main model.
            aliases={**s.aliases, "claude-*": s.aliases.get("claude-*", s.served_model_name)},
            memory=self.memory,
            make_engine=lambda spec: Engine(spec.name, spec.path, config, self.world),
            make_lane=lambda name: AdmissionLane(f"model {name!r}", 4, s.waiting_room),
            keep_alive=s.keep_alive if not self.world.distributed else lambda name: 0.0,
            pinned=frozenset(s.pinned_models) | _pinned_in_a_world(self.world, s),
            max_loaded=s.max_loaded_models,
            load_queue=s.waiting_room,
            weights_estimate=_weights_estimate,
        )
        self.models.on_loaded += [_size_lane, self._count_weights]
        # Prompt rendering and tokenization (count_tokens included) are CPU work
        # beside the engines: one at a time, so they cannot starve generation.
        self.render_lane = AdmissionLane(
            "prompt rendering", 1, 2 * (s.waiting_room + MAX_CAPACITY * len(self.models.names()))
        )
        self.metrics = Metrics(self._live_sources)
        self.cache_watch = CacheWatch()
        self.sealer = ReasoningSealer.from_key_file(s.data_path / "reasoning.key")

    @property
    def lanes(self) -> dict[str, AdmissionLane]:
        """Each served model's admission lane, by name."""
        return {resident.name: resident.lane for resident in self.models}

    def _count_weights(self, resident: Resident) -> None:
        """The loaded weights count against the memory budget."""
        assert resident.engine is not None and resident.engine.loaded is not None
        self.memory.weights[resident.name] = resident.engine.loaded.weights_bytes

    def _prefix_caches(self) -> Iterator[tuple[Callable[[], int], Callable[[int], int]]]:
        for engine in self.models.engines():
            index = engine.cache.index
            yield partial(getattr, index, "nbytes"), index.shrink

    def _live_sources(self) -> Iterator[tuple[str, Any, Any]]:
        for resident in self.models:
            if resident.engine is not None:
                yield resident.name, resident.engine, resident.lane

    def start(self, nursery: trio.Nursery) -> None:
        """Start loading every model, each on its own engine thread, and return.

        The server answers while models load: ``/health`` says 503 and generation
        routes answer 503 until an engine is ready; a model that fails to load
        stays 503 with the reason.
        """
        self._nursery = nursery
        log.info("CPU BLAS: %s; memory limit %s", blas.describe(), gib(self.memory.limit))
        self.models.start(nursery, preload=[self.models.default_name])
        if self.world.distributed:
            nursery.start_soon(self._watch_ranks)
        self.started = True

    async def _watch_ranks(self) -> None:
        """A model served across ranks fails the server when the world fails."""
        resident = self.models.default
        if resident.load_done is not None:
            await resident.load_done.wait()
        if resident.engine is not None:
            await resident.engine.watch_ranks()
        self.fatal.set()

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background for as long as the app serves
        (work that must outlive the request that asked for it)."""
        assert self._nursery is not None, "spawn() before start()"
        self._nursery.start_soon(fn, *args)

    async def start_job(self, fn: Callable[..., Awaitable[object]], *args: Any) -> Any:
        """Like :meth:`spawn`, but wait until ``fn`` reports it started (Trio's
        ``task_status`` protocol): an exception it raises before that reaches
        the caller, not the server."""
        assert self._nursery is not None, "start_job() before start()"
        return await self._nursery.start(fn, *args)

    async def open_store(self, nursery: trio.Nursery) -> None:
        """Open the response store and start its expiry sweep. A store that cannot
        be opened is logged and tried again every :data:`STORE_RETRY` seconds in
        the background; meanwhile generation works, and what needs the store
        answers 503 (``store_configured`` is True, ``store`` None)."""
        url = self.settings.store_url
        if url is None:
            log.info("response store disabled (database_url=none)")
            return
        try:
            store = ResponseStore(url, timeout=self.settings.store_timeout)
        except Exception as exc:  # an unparsable URL; its text may hold a password
            log.error(
                "the response store URL is not usable (%s); continuing without a store",
                type(exc).__name__,
            )
            return
        self.store_configured = True
        if not await self._try_open(store, "continuing without it; retrying in the background"):
            nursery.start_soon(self._open_later, store, nursery)
            return
        await self._share_sealing_key(store)
        self._use_store(store, nursery)

    async def _try_open(self, store: ResponseStore, then: str) -> bool:
        try:
            await store.open()
        except StoreError as exc:
            log.error(
                "cannot open the response store at %s: %s (%s); %s",
                store.redacted_url,
                exc,
                exc.detail,
                then,
            )
            return False
        return True

    async def _open_later(self, store: ResponseStore, nursery: trio.Nursery) -> None:
        while True:
            await trio.sleep(STORE_RETRY)
            if await self._try_open(store, f"retrying in {STORE_RETRY:.0f} s"):
                log.info("response store ready now: %s", store.redacted_url)
                await self._share_sealing_key(store)
                self._use_store(store, nursery)
                return

    async def _share_sealing_key(self, store: ResponseStore) -> None:
        """Seal with the key kept in the store, so that every server sharing it
        (replicas behind a load balancer) reads the others' blobs; the first
        server to open the store offers its own key file's, so blobs issued
        before keep working. Blobs sealed with the file's key still open."""
        try:
            key = await store.shared_secret(SEALING_KEY, self.sealer.key)
        except StoreError as exc:
            log.warning(
                "cannot read the shared reasoning key from the store: %s (%s); "
                "other servers sharing it will not read this one's reasoning blobs",
                exc,
                exc.detail,
            )
            return
        self.sealer = self.sealer.with_key(key)

    def _use_store(self, store: ResponseStore, nursery: trio.Nursery) -> None:
        self.store = store
        nursery.start_soon(self._sweep_forever, store)

    async def _sweep_forever(self, store: ResponseStore) -> None:
        while True:
            try:
                removed = await store.sweep()
                if removed:
                    log.info("response store: removed %d expired responses", removed)
            except StoreError as exc:
                log.warning("response store sweep failed: %s (%s)", exc, exc.detail)
            await trio.sleep(self.settings.store_sweep_interval)

    async def drain(self, grace: float | None = None) -> None:
        """Refuse new generations; let in-flight ones finish within ``grace``
        seconds (default: the shutdown_grace setting), then cancel them (each
        stream still sends its terminal event)."""
        grace = self.settings.shutdown_grace if grace is None else grace
        self.models.closed = True
        async with trio.open_nursery() as nursery:
            for engine in self.models.engines():
                nursery.start_soon(engine.drain, grace)
        # Background jobs whose generation just ended still store how it ended.
        with trio.move_on_after(self.settings.store_write_timeout + 1):
            for job in self.jobs.running():
                await job.done.wait()

    async def stop(self) -> None:
        self.models.closed = True
        async with trio.open_nursery() as nursery:
            for engine in self.models.engines():
                nursery.start_soon(engine.stop, self.settings.shutdown_grace)
        if self.store is not None:
            await self.store.close()


def _main_only(settings: Settings) -> list[ModelSpec]:
    """Across ranks the main model is served alone, loaded at start."""
    name, path = configured(settings)[0]
    return [ModelSpec(name, path, "model")]


def _pinned_in_a_world(world: World, settings: Settings) -> frozenset[str]:
    return frozenset({settings.served_model_name}) if world.distributed else frozenset()
