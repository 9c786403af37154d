"""One memory budget across the served models: memory that cannot crash the
machine.

What counts against ``memory_limit_bytes``: each loaded model's weights, and
the KV cache that every admitted request can reach (its prompt plus its
output cap, at the model's bytes per token). The prefix caches live in what is
left and shrink first: they are never reserved up front, and a request that
needs their room gets it (least recently used entries go first).

A request is weighed twice:

* at :func:`~.pipeline.prepare`, before any header goes out, against the whole
  budget: one that could not fit even with nothing else running is refused at
  once, with a message that names the limit;
* when it has its admission slot, against what is free now: it waits for
  memory while others run (a checkpoint: a hang-up while waiting costs
  nothing), and is refused with a 503 and ``Retry-After`` if none frees within
  :data:`MEMORY_WAIT` seconds.

On a Mac running out of unified memory is a crash or a kernel panic, not an
error; on Linux it is the OOM killer. The auto budget leaves the system room.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import trio

from ..http.errors import ApiError
from ..settings import physical_memory

log = logging.getLogger("mlxtrio.memory")

AUTO_SHARE = 0.75  # of physical memory, when memory_limit_bytes is 0 (auto)
MEMORY_WAIT = 30.0  # seconds an admitted request waits for memory before a 503


def auto_limit(memory: int | None = None) -> int:
    """The budget when none is set: three quarters of physical memory."""
    return int((memory or physical_memory()) * AUTO_SHARE)


def gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"


@dataclass
class MemoryBudget:
    """``limit`` bytes for weights, admitted KV and (in what is left) the
    prefix caches. ``caches`` yields, when asked, each prefix cache as a pair
    of functions: its bytes held now, and one that shrinks it to a size."""

    limit: int
    caches: Callable[[], Iterable[tuple[Callable[[], int], Callable[[int], int]]]] = lambda: ()
    weights: dict[str, int] = field(default_factory=dict)
    reserved: int = 0
    _freed: trio.Event = field(default_factory=trio.Event)

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def cached_bytes(self) -> int:
        return sum(held() for held, _ in self.caches())

    @property
    def free(self) -> int:
        """What a new reservation may take now, the prefix caches given up."""
        return self.limit - self.weights_bytes - self.reserved

    def check_fits(self, need: int, what: str) -> None:
        """Refuse at once (400) a request whose KV could not fit even with
        nothing else running: waiting would never help."""
        room = self.limit - self.weights_bytes
        if need <= room:
            return
        raise ApiError(
            400,
            f"prompt is too long for this server's memory: {what} needs {gib(need)} of KV "
            f"cache, and memory_limit_bytes ({gib(self.limit)}) leaves {gib(max(room, 0))} "
            "beside the loaded weights; shorten the input or lower max_tokens",
            "invalid_request_error",
            param="input",
            code="context_length_exceeded",
        )

    @contextlib.asynccontextmanager
    async def reserved_for(self, need: int, what: str) -> AsyncIterator[None]:
        """Hold ``need`` bytes while the body runs: the prefix caches shrink
        to make room, then it waits (at most :data:`MEMORY_WAIT` seconds) for
        running requests to release theirs. Cancellation leaves nothing
        reserved; a wait that runs out is a 503 that says "memory"."""
        taken = False
        with trio.move_on_after(MEMORY_WAIT):
            while not self._take(need):
                await self._freed.wait()
            taken = True
        if not taken:
            raise ApiError(
                503,
                f"not enough memory for this request now: {what} needs {gib(need)} of KV "
                f"cache, {gib(max(self.free, 0))} of memory_limit_bytes ({gib(self.limit)}) "
                "is free while other requests run; retry shortly",
                "server_error",
                code="memory_exhausted",
                headers={"Retry-After": "5"},
            )
        try:
            yield
        finally:
            self._release(need)

    def _take(self, need: int) -> bool:
        """Reserve ``need`` now if it fits once the prefix caches have given
        up what they must."""
        if need > self.free:
            return False
        self._make_room(self.free - need)
        self.reserved += need
        return True

    def _make_room(self, room: int) -> None:
        """Shrink the prefix caches, largest first, so they hold at most
        ``room`` bytes together."""
        excess = self.cached_bytes - room
        for held, shrink in sorted(self.caches(), key=lambda pair: -pair[0]()):
            if excess <= 0:
                return
            size = held()
            excess -= size - shrink(max(0, size - excess))

    def _release(self, need: int) -> None:
        self.reserved -= need
        self._freed.set()
        self._freed = trio.Event()

    def describe(self) -> dict[str, int]:
        """For ``/health``."""
        return {
            "limit_bytes": self.limit,
            "weights_bytes": self.weights_bytes,
            "reserved_kv_bytes": self.reserved,
            "prefix_cache_bytes": self.cached_bytes,
        }
