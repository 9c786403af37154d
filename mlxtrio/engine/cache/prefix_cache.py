"""One engine's prefix cache, as the engine holds it: the Trio-side indexes
(memory and disk) and lookups, and the engine-thread KV tiers, which outlive a
restarted engine thread.

The two sides meet through the engine's command queue: the index's evictions
become ``Drop`` commands, a disk block that is gone becomes ``ForgetDisk``, a
lookup that waits for a running sequence's KV sends ``Share`` (see
:mod:`mlxtrio.engine.commands`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from functools import partial
from pathlib import Path

from ..commands import Command, Drop, ForgetDisk, Share
from ..handle import GenerationHandle
from ..model import LoadedModel
from ..types import EngineStats, Match
from .disk_index import DiskIndex
from .prefix_index import PrefixIndex
from .reuse import PrefixReuse
from .snapshots import KVTiers

Post = Callable[..., None]  # hand a call to the Trio thread (from the engine thread)


class PrefixCache:
    """``memory_bytes`` of KV in memory (0: no cache), ``disk_bytes`` in block
    files under ``directory`` (0 or no directory: no disk tier). ``send`` puts
    a command on the engine's queue; ``live`` is the engine's set of live
    handles, which lookups may wait on."""

    def __init__(
        self,
        memory_bytes: int,
        disk_bytes: int,
        directory: Path | None,
        send: Callable[[Command], None],
        live: Iterable[GenerationHandle],
        stats: EngineStats,
    ) -> None:
        self._send = send
        self._directory = directory
        disk = None
        if memory_bytes > 0 and disk_bytes > 0 and directory is not None:
            disk = DiskIndex(disk_bytes, self._forget_disk_blocks)
        self.index = PrefixIndex(memory_bytes, self._drop_snapshots, disk)
        self.reuse = PrefixReuse(self.index, live, stats, self._request_share)
        self.kv = KVTiers()  # engine thread

    @property
    def enabled(self) -> bool:
        return self.index.enabled

    # -- Trio side ---------------------------------------------------------------

    async def lookup(
        self, loaded: LoadedModel | None, key: Hashable, prompt: list[int]
    ) -> Match | None:
        """See :meth:`mlxtrio.engine.engine.Engine.lookup`."""
        return await self.reuse.lookup(loaded, key, prompt)

    def release(self, match: Match | None) -> None:
        """Unpin a match; idempotent."""
        self.index.release(match)

    def _request_share(self, handle: GenerationHandle, at: int) -> None:
        self._send(Share(handle, at))

    def _drop_snapshots(self, entry_ids: list[int]) -> None:
        self._send(Drop(tuple(entry_ids)))

    def _forget_disk_blocks(self, names: list[bytes]) -> None:
        self._send(ForgetDisk(tuple(names)))

    def _disk_written(self, name: bytes, size: int | None) -> None:
        """A block file was written (``size`` None: writing it failed)."""
        if self.index.disk is None:
            return
        if size is None:
            self._forget_disk_blocks([name])  # so the engine may spill it again
        else:
            self.index.disk.added([(name, size)])

    # -- engine thread -------------------------------------------------------------

    def open_disk(self, loaded: LoadedModel, owner: str, post: Post) -> None:
        """Find the block files an earlier run left for these weights and start
        the writer (engine thread, before serving: a listing of the directory).
        ``post`` hands the index's updates to the Trio thread."""
        if self.index.disk is None or self._directory is None:
            return
        written = partial(post, self._disk_written)
        found = self.kv.open_disk(self._directory, loaded.fingerprint, owner, written)
        if found is not None:
            self.reuse.disk_dir = self.kv.directory
            post(self.index.disk.added, found)
