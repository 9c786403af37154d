"""Token-prefix KV cache: many conversations stay warm at once.

The cache is split in two so that a match is exact *before* response headers go
out, without the Trio loop ever touching MLX state:

* :class:`PrefixIndex` (Trio thread, pure Python) knows which token sequences have
  a KV snapshot: mlx-lm's ``PromptTrie`` per (model, isolation domain), an LRU
  order and a byte budget. Lookups, pins and eviction decisions happen here.
* The engine thread holds the snapshots themselves (mlx-lm cache objects) by entry
  id, copies and trims them when a sequence starts from one, and drops them only
  when the index says so.

A matched entry is *pinned* from lookup until its sequence has been inserted in the
engine, so it cannot be evicted while the request waits for an admission slot.
Snapshots whose caches cannot be trimmed (rotating or recurrent layers) are only
reused at their exact boundary; a shorter reuse would need a trim that would give
wrong output.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from mlx_lm.models.cache import PromptTrie


@dataclass
class Entry:
    id: int
    key: Hashable  # (model, domain)
    tokens: list[int]
    nbytes: int
    trimmable: bool
    pins: int = 0


@dataclass
class Match:
    """A reusable prefix: the first ``length`` tokens of ``entry``."""

    entry: Entry
    length: int
    _released: bool = field(default=False, repr=False)


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

    def __init__(self, budget_bytes: int, drop: Callable[[list[int]], None]) -> None:
        self.budget_bytes = budget_bytes
        self._drop = drop
        self._trie = PromptTrie()
        self._entries: dict[int, Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.stats = CacheStats()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookup ----------------------------------------------------------------

    def lookup(self, key: Hashable, tokens: list[int]) -> Match | None:
        """The longest reusable prefix of ``tokens`` (at least one token is always
        left to feed the model), pinned; or None. Counts a hit or a miss."""
        match = self._best(key, tokens) if self.enabled and len(tokens) > 1 else None
        if match is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.cached_tokens += match.length
        match.entry.pins += 1
        self._lru.move_to_end(match.entry.id)
        return match

    def _best(self, key: Hashable, tokens: list[int]) -> Match | None:
        limit = len(tokens) - 1
        result = self._trie.search(key, tokens)
        candidates: list[Match] = []
        if result.exact is not None:
            entry = self._trie.get(key, result.exact)
            candidates.append(Match(entry, min(limit, len(entry.tokens))))
        if result.shorter is not None:
            entry = self._trie.get(key, result.shorter)
            candidates.append(Match(entry, len(entry.tokens)))
        if result.longer is not None:
            entry = self._trie.get(key, result.longer)
            candidates.append(Match(entry, min(limit, result.common_prefix)))
        usable = [
            m
            for m in candidates
            if 0 < m.length <= limit and (m.entry.trimmable or m.length == len(m.entry.tokens))
        ]
        return max(usable, key=lambda m: m.length, default=None)

    def release(self, match: Match | None) -> None:
        """Unpin (idempotent). Call once the sequence is in the engine, or when the
        request ends without reaching it."""
        if match is None or match._released:
            return
        match._released = True
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
        self.stats.inserts += 1
        old = self._entries_at(entry.key, entry.tokens)
        dropped = [old.id] if old is not None and old.pins == 0 else []
        if old is not None:
            if old.pins:  # still in use: keep it alive, just not indexed
                self._forget(old)
            else:
                self._remove(old)
        self._trie.add(entry.key, entry.tokens, entry)
        self._entries[entry.id] = entry
        self._lru[entry.id] = None
        self.nbytes += entry.nbytes
        if entry.trimmable:  # prefixes of a trimmable snapshot are redundant
            for prefix_len, prefix in self._trie.pop_prefixes(entry.key, entry.tokens):
                if prefix is entry:
                    continue
                if prefix.pins:
                    self._trie.add(
                        entry.key, entry.tokens[:prefix_len], prefix
                    )  # keep while pinned
                    continue
                self._entries.pop(prefix.id, None)
                self._lru.pop(prefix.id, None)
                self.nbytes -= prefix.nbytes
                dropped.append(prefix.id)
        if dropped:
            self._drop(dropped)
        self._evict_over_budget()

    def _entries_at(self, key: Hashable, tokens: list[int]) -> Entry | None:
        try:
            return self._trie.get(key, tokens)
        except KeyError:
            return None

    def _evict_over_budget(self) -> None:
        victims = []
        for entry_id in list(self._lru):
            if self.nbytes <= self.budget_bytes:
                break
            entry = self._entries[entry_id]
            if entry.pins:
                continue
            self._remove(entry, notify=False)
            victims.append(entry.id)
            self.stats.evictions += 1
        if victims:
            self._drop(victims)

    def _forget(self, entry: Entry) -> None:
        self._trie.pop(entry.key, entry.tokens)
        self._entries.pop(entry.id, None)
        self._lru.pop(entry.id, None)
        self.nbytes -= entry.nbytes

    def _remove(self, entry: Entry, notify: bool = False) -> None:
        self._forget(entry)
        if notify:
            self._drop([entry.id])

    def clear(self) -> None:
        ids = list(self._entries)
        for entry in list(self._entries.values()):
            self._forget(entry)
        if ids:
            self._drop(ids)
