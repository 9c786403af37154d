"""Models are resources, not start-up arguments: loaded on the first request
that names them, evicted least recently used under the memory budget, unloaded
after an idle time.

* **Names.** A request's ``model`` is a served name (see :mod:`.catalog`), an
  exact alias, or matches an alias pattern (``claude-*``); anything else is a
  404 listing what is served. Resolving a name never loads anything.
* **Load on first use** (:meth:`Residency.acquire`): one load at a time; the
  requests waiting for a model count in a bounded load queue (429 with
  ``Retry-After`` when it is full) and keep waiting if one of them hangs up
  (the load finishes for the next request). ``/health`` shows a load's
  progress (bytes of weights read of the total) and the log its time.
* **A memory budget across models** (:mod:`.memory`): a model is loaded only
  when its weights fit beside the loaded ones and the KV that admitted
  requests hold; the least recently used *idle* models are unloaded to make
  room (never one with a request in flight, never a pinned one). A load that
  cannot fit now waits (bounded) for models to go idle, then gets a 503. An
  unloaded model's disk KV tier stays: a reload starts warm.
* **Idle release**: a model nobody used for its ``keep_alive_seconds`` (0 =
  never) is unloaded within a few seconds (:meth:`Residency.sweep`).
* ``max_loaded_models`` (0 = the budget alone decides) bounds how many stay
  loaded at once.

Trio thread only.
"""

from __future__ import annotations

import enum
import fnmatch
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import trio

from ..engine.engine import Engine, EngineState
from ..engine.handle import EngineError
from ..http.errors import ApiError, rate_limited, unavailable
from .admission import AdmissionLane
from .catalog import ModelSpec
from .memory import MemoryBudget, gib

log = logging.getLogger("mlxtrio.models")

SWEEP_INTERVAL = 1.0  # seconds between idle checks
LOAD_WAIT = 60.0  # seconds a load waits for busy models to go idle before a 503


class ModelState(enum.Enum):
    AVAILABLE = "available"
    LOADING = "loading"
    LOADED = "loaded"


class UnknownModel(LookupError):
    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(f'Model "{name}" not found. Available models: {", ".join(available)}')
        self.name = name


@dataclass
class Resident:
    """One servable model and, while it is loaded, its engine."""

    spec: ModelSpec
    lane: AdmissionLane
    pinned: bool = False
    keep_alive: float = 0.0  # seconds idle before it is unloaded (0: never)
    engine: Engine | None = None
    users: int = 0  # calls using it now (it is never evicted meanwhile)
    waiting: int = 0  # calls waiting for its load
    last_used: float = field(default_factory=time.monotonic)
    load_done: trio.Event | None = None  # set when a load in progress ends
    # Why the last load did not happen (no room), for the requests waiting on it.
    load_failure: ApiError | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state(self) -> ModelState:
        if self.load_done is not None:
            return ModelState.LOADING
        return ModelState.LOADED if self.engine is not None else ModelState.AVAILABLE

    @property
    def idle(self) -> bool:
        return self.users == 0 and self.waiting == 0 and self.load_done is None


EngineFactory = Callable[[ModelSpec], Engine]


class Residency:
    """The served models. ``make_engine`` builds a model's engine (not yet
    launched); ``on_loaded`` runs once a model serves; ``spawn`` starts work
    that outlives the request asking for it (the server's nursery)."""

    def __init__(
        self,
        specs: list[ModelSpec],
        *,
        default: str,
        aliases: Mapping[str, str],
        memory: MemoryBudget,
        make_engine: EngineFactory,
        make_lane: Callable[[str], AdmissionLane],
        keep_alive: Callable[[str], float],
        pinned: frozenset[str] = frozenset(),
        max_loaded: int = 0,
        load_queue: int = 16,
        weights_estimate: Callable[[ModelSpec], int] = lambda spec: spec.size_bytes,
    ) -> None:
        self._residents = {
            spec.name: Resident(
                spec, make_lane(spec.name), spec.name in pinned, keep_alive(spec.name)
            )
            for spec in specs
        }
        self.default_name = default
        self.aliases = dict(aliases)
        self.memory = memory
        self._make_engine = make_engine
        self._max_loaded = max_loaded
        self._load_queue = load_queue
        self._estimate = weights_estimate
        self._load_lock = trio.Lock()  # one load at a time
        self._nursery: trio.Nursery | None = None
        self.on_loaded: list[Callable[[Resident], None]] = []
        self.closed = False  # shutting down: nothing more is loaded

    # -- names ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[Resident]:
        return iter(self._residents.values())

    def engines(self) -> Iterator[Engine]:
        """The engines of the models loaded (or loading) now."""
        return (r.engine for r in self._residents.values() if r.engine is not None)

    @property
    def default(self) -> Resident:
        return self._residents[self.default_name]

    def names(self) -> list[str]:
        return list(self._residents)

    def resolve(self, name: str) -> Resident:
        """The model ``name`` stands for: a served name, an exact alias, then
        alias patterns in the order configured. Loads nothing."""
        if name in self._residents:
            return self._residents[name]
        target = self.aliases.get(name)
        if target is None:
            for pattern, candidate in self.aliases.items():
                if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern):
                    target = candidate
                    break
        if target is not None and target in self._residents:
            return self._residents[target]
        plain_aliases = [a for a in self.aliases if not any(c in a for c in "*?[")]
        raise UnknownModel(name, self.names() + plain_aliases)

    # -- use ------------------------------------------------------------------------

    def start(self, nursery: trio.Nursery, preload: list[str]) -> None:
        """Load ``preload`` (the ``--model``) now, and sweep idle models."""
        self._nursery = nursery
        for name in preload:
            resident = self._residents[name]
            resident.load_done = trio.Event()
            nursery.start_soon(self._load, resident)
        nursery.start_soon(self.sweep)

    def use(self, resident: Resident) -> Callable[[], None]:
        """Count a call using ``resident`` (it is not evicted meanwhile); call
        the returned function when the call ends."""
        resident.users += 1

        def done() -> None:
            resident.users -= 1
            resident.last_used = time.monotonic()

        return done

    async def acquire(self, resident: Resident) -> Engine:
        """``resident``'s engine, loading the model first if it is not loaded
        (waiting for a load in progress). A full load queue is a 429; a model
        that cannot load, or cannot fit in memory now, a 503. Cancellation:
        the waiting stops; the load goes on for the next request."""
        resident.last_used = time.monotonic()
        while resident.engine is None or resident.load_done is not None:
            if self.closed and resident.engine is None:
                raise unavailable("the server is shutting down; retry")
            if resident.load_done is None:
                resident.load_done = trio.Event()
                resident.load_failure = None
                self._spawn(self._load, resident)
            await self._wait_for_load(resident)
            if resident.engine is None:
                raise resident.load_failure or unavailable(
                    f"Model {resident.name!r} could not be loaded; retry"
                )
        return resident.engine

    async def _wait_for_load(self, resident: Resident) -> None:
        if resident.waiting >= self._load_queue:
            raise rate_limited(
                f"Model queue full: {resident.waiting} requests wait for model "
                f"{resident.name!r} to load (limit {self._load_queue}). Retry after 1s."
            )
        resident.waiting += 1
        try:
            done = resident.load_done
            assert done is not None
            await done.wait()
        finally:
            resident.waiting -= 1

    def _spawn(self, fn: Callable[..., object], *args: object) -> None:
        assert self._nursery is not None, "Residency.start() first"
        self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    # -- loading and unloading ------------------------------------------------------

    async def _load(self, resident: Resident) -> None:
        """Load ``resident`` (in the server's nursery: the load outlives the
        request that asked for it), making room first."""
        done = resident.load_done
        try:
            async with self._load_lock:
                await self._make_room(resident)
                engine = self._make_engine(resident.spec)
                resident.engine = engine
                engine.launch()
                try:
                    await engine.wait_ready()
                except EngineError:
                    return  # the engine stays, failed: /health and requests say why
                resident.last_used = time.monotonic()
                for hook in self.on_loaded:
                    hook(resident)
                assert engine.loaded is not None
                log.info("model %s loaded in %.2f s", resident.name, engine.loaded.load_seconds)
        except ApiError as exc:  # no room for it
            log.error("model %s is not loaded: %s", resident.name, exc.message)
            resident.load_failure = exc
        finally:
            resident.load_done = None
            if done is not None:
                done.set()

    async def _make_room(self, resident: Resident) -> None:
        """Unload least recently used idle models until ``resident`` fits the
        memory budget and ``max_loaded_models``; wait (bounded) while busy
        models hold the room."""
        need = self._estimate(resident.spec)
        if need > self.memory.limit:
            raise ApiError(
                400,
                f"model {resident.name!r} needs about {gib(need)} of memory for its weights, "
                f"more than memory_limit_bytes ({gib(self.memory.limit)})",
                param="model",
            )
        with trio.move_on_after(LOAD_WAIT):
            while not self._fits(need):
                victim = self._least_recently_used_idle(resident)
                if victim is None:
                    await trio.sleep(SWEEP_INTERVAL)  # until a busy model goes idle
                    continue
                await self.unload(victim, "to make room for " + resident.name)
            return
        raise unavailable(
            f"not enough memory to load model {resident.name!r} now: it needs about "
            f"{gib(need)}, and the models in use hold the rest of memory_limit_bytes "
            f"({gib(self.memory.limit)}); retry shortly"
        )

    def _fits(self, need: int) -> bool:
        loaded = sum(1 for r in self._residents.values() if r.engine is not None)
        if self._max_loaded and loaded >= self._max_loaded:
            return False
        return self.memory.weights_bytes + self.memory.reserved + need <= self.memory.limit

    def _least_recently_used_idle(self, exclude: Resident) -> Resident | None:
        candidates = [
            r
            for r in self._residents.values()
            if r is not exclude and r.engine is not None and r.idle and not r.pinned
        ]
        return min(candidates, key=lambda r: r.last_used, default=None)

    async def unload(self, resident: Resident, why: str) -> None:
        """Stop ``resident``'s engine and let go of its weights (the disk KV
        tier stays). Cancellation: the unload goes on (shielded)."""
        engine = resident.engine
        if engine is None:
            return
        with trio.CancelScope(shield=True):
            log.info("unloading model %s (%s)", resident.name, why)
            resident.engine = None
            self.memory.weights.pop(resident.name, None)
            await engine.stop(1.0, unload=True)

    async def load(self, resident: Resident) -> Engine:
        """Load ``resident`` now (the load endpoint); see :meth:`acquire`."""
        done = self.use(resident)
        try:
            return await self.acquire(resident)
        finally:
            done()

    async def sweep(self) -> None:
        """Unload models idle for longer than their keep-alive (forever; in
        the server's nursery)."""
        while True:
            await trio.sleep(SWEEP_INTERVAL)
            now = time.monotonic()
            for resident in list(self._residents.values()):
                if (
                    resident.engine is not None
                    and resident.idle
                    and not resident.pinned
                    and resident.keep_alive > 0
                    and now - resident.last_used >= resident.keep_alive
                    and resident.engine.state is EngineState.READY
                ):
                    await self.unload(resident, f"idle for {resident.keep_alive:g} s")
