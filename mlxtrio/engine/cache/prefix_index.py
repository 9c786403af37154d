"""Token-prefix KV cache: many conversations stay warm at once.

The cache is split in two so that a match is exact *before* response headers go
out, without the Trio loop ever touching MLX state:

* :class:`PrefixIndex` (Trio thread, pure Python) knows which token sequences have
  a KV snapshot: a :class:`~.radix.RadixTree` per (model, isolation domain), an
  LRU order and a byte budget. Lookups, pins and eviction decisions happen here;
  a lookup is linear in the prompt length, so it never stalls the loop.
* The engine thread holds the snapshots themselves by entry id (:mod:`.kv_store`:
  shared 256-token blocks plus a private tail, or a whole cache that cannot be
  cut), assembles a private cache when a sequence starts from one, and drops
  them only when the index says so. The index counts each shared block once,
  so its bytes are the bytes held.
* A :class:`~.disk_index.DiskIndex` lists the blocks on disk: a lookup may go
  on past the memory match with blocks read back from files (see
  :meth:`mlxtrio.engine.engine.Engine.lookup`).

A matched entry is *pinned* from lookup until its sequence has been inserted in the
engine, so it cannot be evicted while the request waits for an admission slot.
Snapshots whose caches cannot be trimmed (rotating or recurrent layers) are only
reused at their exact boundary; a shorter reuse would need a trim that would give
wrong output.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ..types import BLOCK_TOKENS, Entry, Match
from .disk_index import DiskIndex
from .radix import PrefixMatch, RadixTree


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    inserts: int = 0


class PrefixIndex:
    """Owned by the Trio thread. ``drop`` is called with the ids of evicted entries
    (the engine frees their snapshots)."""

    def __init__(
        self,
        budget_bytes: int,
        drop: Callable[[list[int]], None],
        disk: DiskIndex | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._drop = drop
        self.disk = disk
        self._trees: dict[Hashable, RadixTree[Entry]] = {}
        self._entries: dict[int, Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._block_refs: dict[bytes, int] = {}  # shared blocks: snapshots naming each
        self.reading_bytes = 0  # disk blocks read for sequences not yet started
        self._bytes_per_token = 0.0  # of the last snapshot seen
        self.nbytes = 0  # own KV of every snapshot, plus each shared block once
        self.stats = CacheStats()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookup ----------------------------------------------------------------

    def lookup(
        self, key: Hashable, tokens: list[int], names: Callable[[], list[bytes]] | None = None
    ) -> Match | None:
        """The longest reusable prefix of ``tokens`` (at least one token is always
        left to feed the model), pinned; or None. ``names`` gives the chain names
        of the prompt's full blocks (for the disk tier). Counts a hit or a miss."""
        match = self._best(key, tokens) if self.enabled and len(tokens) > 1 else None
        if names is not None and self.disk is not None and len(self.disk):
            match = self._extended_from_disk(match, names(), len(tokens) - 1)
        if match is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.cached_tokens += match.length
        if match.entry is not None:
            match.entry.pins += 1
            self._lru.move_to_end(match.entry.id)
        return match

    def _extended_from_disk(
        self, match: Match | None, names: list[bytes], limit: int
    ) -> Match | None:
        """``match``, or a longer one that goes on with blocks from disk. Disk
        blocks follow the memory snapshot's whole blocks (its tail is private)."""
        assert self.disk is not None
        names = names[: limit // BLOCK_TOKENS]
        memory = match.length // BLOCK_TOKENS if match is not None else 0
        if match is not None and match.entry is not None and not match.entry.blocks:
            memory = 0  # a whole (uncut) snapshot: disk blocks cannot follow it
        on_disk = self.disk.run(names[memory:])
        if (memory + on_disk) * BLOCK_TOKENS <= (match.length if match else 0):
            return match
        entry = match.entry if match is not None and memory else None
        return Match(entry, (memory + on_disk) * BLOCK_TOKENS, tuple(names[memory:][:on_disk]))

    def reserve_reads(self, match: Match) -> int:
        """How many of ``match``'s disk blocks may be read now, their bytes
        counted from now until the match is released: blocks read for
        sequences that have not started are held in memory beside the cache,
        up to a quarter of its budget (however many lookups read at once)."""
        assert self.disk is not None
        room = self.budget_bytes // 4 - self.reading_bytes
        count = reserved = 0
        for name in match.disk:
            size = self.disk.size(name)
            if reserved + size > room:
                break
            reserved += size
            count += 1
        match.loaded_nbytes = reserved
        self.reading_bytes += reserved
        return count

    def loading(self, match: Match, blocks: list[Any]) -> None:
        """``blocks`` were read for ``match``: their bytes replace what was
        reserved, until it is released."""
        match.loaded = blocks
        nbytes = sum(k.nbytes + v.nbytes for layers, _ in blocks for k, v in layers)
        self.reading_bytes += nbytes - match.loaded_nbytes
        match.loaded_nbytes = nbytes

    def would_hold(self, tokens: int) -> bool:
        """Whether a snapshot of ``tokens`` tokens fits the budget (about)."""
        return tokens * self._bytes_per_token <= self.budget_bytes

    def shorten(self, match: Match, readable: int) -> Match | None:
        """``match`` with only its first ``readable`` disk blocks (the others
        could not be read); None if nothing is left. Keeps the pin."""
        lost = (len(match.disk) - readable) * BLOCK_TOKENS
        self.stats.cached_tokens -= lost
        match.disk = match.disk[:readable]
        match.length -= lost
        if match.length == 0:
            self.stats.hits -= 1
            self.stats.misses += 1
            self.release(match)
            return None
        return match

    def held_length(self, key: Hashable, tokens: list[int]) -> int:
        """How long a prefix of ``tokens`` memory holds (no pin, no counting)."""
        match = self._best(key, tokens) if self.enabled and len(tokens) > 1 else None
        return match.length if match is not None else 0

    def _best(self, key: Hashable, tokens: list[int]) -> Match | None:
        """The longest usable prefix: a whole snapshot that is a prefix of
        ``tokens``, or, for trimmable snapshots, the common prefix with any one
        (trimmed to it). At least one token is left to feed the model."""
        tree = self._trees.get(key)
        if tree is None:
            return None
        limit = len(tokens) - 1
        found = tree.match(tokens)
        best: Match | None = None
        for length, entry in found.on_path:
            if length <= limit:
                best = Match(entry, length)
        length = min(found.common, limit)
        below = found.below
        if below is not None and below.trimmable and length > (best.length if best else 0):
            best = Match(below, length)
        return best

    def release(self, match: Match | None) -> None:
        """Unpin (idempotent). Call once the sequence is in the engine, or when the
        request ends without reaching it."""
        if match is None or match._released:
            return
        match._released = True
        self.reading_bytes -= match.loaded_nbytes
        match.loaded_nbytes = 0
        if match.entry is None:
            return
        match.entry.pins -= 1
        if match.entry.id in self._entries:
            self._evict_over_budget()
        elif match.entry.pins == 0:  # replaced while pinned: free it now
            self._drop([match.entry.id])

    # -- insertion -------------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """Record a snapshot the engine now holds; evict to stay within budget."""
        if not self.enabled or not entry.tokens:
            self._drop([entry.id])
            return
        if entry.block_nbytes:
            self._bytes_per_token = entry.block_nbytes / BLOCK_TOKENS
        elif not entry.blocks:
            self._bytes_per_token = entry.nbytes / len(entry.tokens)
        if entry.nbytes + len(entry.blocks) * entry.block_nbytes > self.budget_bytes:
            # It would only evict everything, itself last.
            self.stats.evictions += 1
            self._drop([entry.id])
            return
        tree = self._trees.get(entry.key)
        found = tree.match(entry.tokens) if tree is not None else None
        if found is not None and _covered(entry, found):
            self._drop([entry.id])  # a longer trimmable snapshot already holds it
            return
        self.stats.inserts += 1
        dropped: list[int] = []
        if found is not None:
            for length, known in found.on_path:
                # The same tokens: replaced (a pinned one lives on until released).
                # A prefix of a trimmable snapshot: redundant.
                if length == len(entry.tokens) or (entry.trimmable and not known.pins):
                    self._forget(known)
                    if not known.pins:
                        dropped.append(known.id)
        self._trees.setdefault(entry.key, RadixTree()).insert(entry.tokens, entry)
        self._entries[entry.id] = entry
        self._lru[entry.id] = None
        self.nbytes += entry.nbytes
        for name in entry.blocks:
            refs = self._block_refs.get(name, 0)
            self._block_refs[name] = refs + 1
            if not refs:
                self.nbytes += entry.block_nbytes
        if dropped:
            self._drop(dropped)
        self._evict_over_budget()

    def shrink(self, size: int) -> int:
        """Evict least recently used entries (never pinned ones) until at most
        ``size`` bytes are held, or nothing more can go; the bytes held then.
        (The memory budget's way to make room for a request.)"""
        self._evict_to(size)
        return self.nbytes

    def _evict_over_budget(self) -> None:
        self._evict_to(self.budget_bytes)

    def _evict_to(self, size: int) -> None:
        victims = []
        for entry_id in list(self._lru):
            if self.nbytes <= size:
                break
            entry = self._entries[entry_id]
            if entry.pins:
                continue
            self._forget(entry)
            victims.append(entry.id)
            self.stats.evictions += 1
        if victims:
            self._drop(victims)

    def _forget(self, entry: Entry) -> None:
        """Take ``entry`` out of the index (its snapshot is the caller's to drop)."""
        tree = self._trees.get(entry.key)
        if tree is not None and tree.get(entry.tokens) is entry:
            tree.remove(entry.tokens)
            if not tree:
                del self._trees[entry.key]
        if self._entries.pop(entry.id, None) is not None:
            self._lru.pop(entry.id, None)
            self.nbytes -= entry.nbytes
            for name in entry.blocks:
                refs = self._block_refs[name] - 1
                if refs:
                    self._block_refs[name] = refs
                else:
                    del self._block_refs[name]
                    self.nbytes -= entry.block_nbytes

    @property
    def shared_blocks(self) -> int:
        return len(self._block_refs)

    def clear(self) -> None:
        ids = list(self._entries)
        for entry in list(self._entries.values()):
            self._forget(entry)
        if ids:
            self._drop(ids)


def _covered(entry: Entry, found: PrefixMatch[Entry]) -> bool:
    """Whether a longer trimmable snapshot already holds all of ``entry``'s
    tokens (a cancelled copy of a cached prefix, say): storing it would hold the
    same KV twice."""
    longer = found.below
    return (
        found.common == len(entry.tokens)
        and longer is not None
        and longer.trimmable
        and len(longer.tokens) > len(entry.tokens)
    )
