"""Which KV blocks the disk tier holds: names, sizes, least recently used first.

Owned by the Trio thread, like :class:`~.prefix_index.PrefixIndex`; the files
themselves are written, read and deleted off it (:mod:`.disk_tier`). A block is
listed here once its file is complete, and unlisted before its file is deleted,
so a lookup never counts a block that is being written or removed; a file that
turns out unreadable is unlisted when a read finds it so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class DiskIndex:
    """``forget`` is called with the names of blocks evicted to stay within
    ``budget_bytes`` (their files are deleted)."""

    def __init__(self, budget_bytes: int, forget: Callable[[list[bytes]], None]) -> None:
        self.budget_bytes = budget_bytes
        self._forget = forget
        self._files: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evictions = 0
        self.corrupt = 0

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name: bytes) -> bool:
        return name in self._files

    def size(self, name: bytes) -> int:
        """The file's size (about the block's bytes in memory); 0 if unknown."""
        return self._files.get(name, 0)

    def run(self, names: list[bytes]) -> int:
        """How many of ``names``, from the first, are on disk (marked used)."""
        count = 0
        for name in names:
            if name not in self._files:
                break
            self._files.move_to_end(name)
            count += 1
        return count

    def added(self, entries: Iterable[tuple[bytes, int]]) -> None:
        """Files now complete on disk (oldest first); evicts over the budget."""
        for name, nbytes in entries:
            if name in self._files:
                continue
            self._files[name] = nbytes
            self.nbytes += nbytes
        self._evict_over_budget()

    def unreadable(self, names: list[bytes], damaged: bool = True) -> None:
        """Files a read found truncated or corrupt (``damaged``), or gone:
        never offered again."""
        if damaged:
            self.corrupt += len(names)
        self._remove(names)

    def _evict_over_budget(self) -> None:
        victims = []
        while self.nbytes > self.budget_bytes and self._files:
            name, nbytes = self._files.popitem(last=False)
            self.nbytes -= nbytes
            victims.append(name)
        if victims:
            self.evictions += len(victims)
            self._forget(victims)

    def _remove(self, names: list[bytes]) -> None:
        gone = [name for name in names if name in self._files]
        for name in gone:
            self.nbytes -= self._files.pop(name)
        if gone:
            self._forget(gone)
