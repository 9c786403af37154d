"""Finding a request's cached prefix, on the Trio side: in memory, in a
sequence still running, and on disk.

The lookup is done before response headers go out, so ``X-Cached-Tokens`` is
exact: whatever it waits for (a running sequence's KV, blocks read from disk)
is in hand, or given up, when it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from functools import partial
from pathlib import Path

import trio

from ..handle import GenerationHandle
from ..model import LoadedModel
from ..types import EngineStats, Match
from .blocks import BLOCK_TOKENS, chain, root_name
from .disk_tier import read_blocks
from .prefix_index import PrefixIndex
from .radix import common_prefix_length

INFLIGHT_WAITS = 4  # each wait makes the cache hold more; a few suffice
DISK_READERS = 2  # block files read at once, per model


class PrefixReuse:
    """One model's prefix lookups. Trio thread only.

    ``live`` is the engine's set of live handles (read, never changed here);
    ``request_share(handle, at)`` asks the engine to snapshot a live sequence
    once it holds ``at`` tokens; ``disk_dir`` is set once the engine thread
    has opened the disk tier.
    """

    def __init__(
        self,
        index: PrefixIndex,
        live: Iterable[GenerationHandle],
        stats: EngineStats,
        request_share: Callable[[GenerationHandle, int], None],
    ) -> None:
        self.index = index
        self.disk_dir: Path | None = None
        self._live = live
        self._stats = stats
        self._request_share = request_share
        self._readers = trio.CapacityLimiter(DISK_READERS)

    async def lookup(
        self, loaded: LoadedModel | None, key: Hashable, prompt: list[int]
    ) -> Match | None:
        """The longest reusable prefix of ``prompt`` under ``key`` (model,
        domain), pinned until released.

        Waits first, when a sequence still running (prefilling, finishing or
        being cancelled) shares a longer prefix than the cache holds: for its
        KV to be snapshotted, so the prefix is prefilled once. Then reads the
        matched blocks that are only on disk, on a worker thread. Cancelling
        the call abandons the wait (nothing stays pinned); a disk read already
        begun is finished first.
        """
        if self.index.enabled:
            await self._wait_for_inflight(loaded, key, prompt)
        names = None
        if loaded is not None and self.disk_dir is not None:
            root = root_name(loaded.fingerprint, key[1])  # type: ignore[index]
            names = partial(chain, root, prompt[: len(prompt) - 1])
        match = self.index.lookup(key, prompt, names)
        if match is None or not match.disk:
            return match
        try:
            return await self._read_disk_blocks(match)
        except BaseException:
            self.index.release(match)
            raise

    async def _read_disk_blocks(self, match: Match) -> Match | None:
        """``match`` with its disk blocks loaded, shortened to those readable
        (and to what the budget for blocks read ahead of their sequence allows)."""
        disk = self.index.disk
        assert self.disk_dir is not None and disk is not None
        affordable = self.index.reserve_reads(match)
        if affordable < len(match.disk):
            shortened = self.index.shorten(match, affordable)
            if shortened is None:
                return None
            match = shortened
        result = await trio.to_thread.run_sync(
            read_blocks, self.disk_dir, match.disk, limiter=self._readers
        )
        if result.failed is not None and (result.damaged or result.gone):
            disk.unreadable([result.failed], damaged=result.damaged)
        if len(result.blocks) < len(match.disk):
            shortened = self.index.shorten(match, len(result.blocks))
            if shortened is None:
                return None
            match = shortened
        self.index.loading(match, result.blocks)
        return match

    async def _wait_for_inflight(
        self, loaded: LoadedModel | None, key: Hashable, prompt: list[int]
    ) -> None:
        """Wait while a live sequence shares at least a block more of
        ``prompt`` than the cache holds, until its KV reaches the cache: a
        running one is snapshotted once it holds the shared tokens, a cancelled
        one as it is removed (within one engine step)."""
        if not any(handle.cache_key == key for handle in self._live):
            return  # the common case: no walk of the cache for it
        plain = loaded is None or loaded.plain_kv
        for _ in range(INFLIGHT_WAITS):
            held = self.index.held_length(key, prompt)
            found = self._sharer(key, prompt, held + BLOCK_TOKENS, plain)
            if found is None:
                return
            sharer, common = found
            sharer.share_at = max(sharer.share_at, common)
            self._request_share(sharer, sharer.share_at)
            self._stats.inflight_waits += 1
            await sharer.kv_ready.wait()

    def _sharer(
        self, key: Hashable, prompt: list[int], at_least: int, plain: bool
    ) -> tuple[GenerationHandle, int] | None:
        """The live sequence sharing the longest prefix of ``prompt`` (at least
        ``at_least`` tokens) whose KV the cache will take and reuse, and that
        length."""
        best: tuple[GenerationHandle, int] | None = None
        limit = len(prompt) - 1
        for handle in self._live:
            if handle.cache_key != key or handle.kv_ready.is_set():
                continue
            common = common_prefix_length(handle.prompt, prompt, limit)
            if common < at_least or (best is not None and common <= best[1]):
                continue
            if not self.index.would_hold(common):
                continue  # its snapshot would be dropped: waiting would only delay
            if not plain and not _whole_prefix_soon(handle, common):
                continue
            best = (handle, common)
        return best


def _whole_prefix_soon(handle: GenerationHandle, common: int) -> bool:
    """For caches that cannot be trimmed: whether ``handle``'s next snapshot
    will be a prefix of the prompt it shares ``common`` tokens with. Only a
    cancelled prefill's is (it holds what was prefilled, no more; one that
    has started generating holds generated tokens too)."""
    in_kv = max(handle.prefilled, handle.stats.cached_tokens)
    still_prefilling = handle.prefilled < len(handle.prompt) - 1
    return handle.cancel_requested and still_prefilling and in_kv <= common
