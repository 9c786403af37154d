"""What the engine loop does with the prefix cache's KV: start sequences from
it, and keep sequences' KV in it.

Engine thread only (every call touches MLX arrays). The Trio side learns of a
snapshot through the outbox, after it is held; it tells the engine to drop one
through the ``drop`` command (see :mod:`.prefix_cache`).

When snapshots are taken:

* when a sequence finishes or is cancelled (what it prefilled, and generated);
* when another request waits to start from a running sequence's prompt (see
  :meth:`mlxtrio.engine.engine.Engine.lookup`), once it holds the tokens that request needs;
* for caches that cannot be trimmed, at exact boundaries while prefilling:
  where the system prompt ends and where the conversation ends, before the
  template's generation prompt (mlx-lm's segment insertion).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..handle import GenerationHandle
from ..model import LoadedModel
from ..sequence import LiveSequence
from ..types import Entry, Match
from .blocks import chain, root_name
from .disk_tier import DiskWriter, from_host, open_tier, to_host
from .kv_store import Block, KVStore, trimmed

log = logging.getLogger("mlxtrio.engine")


class SnapshotOutbox(Protocol):
    """What snapshots tell the Trio thread (each call is one ``run_sync_soon``)."""

    def snapshot(self, entry: Entry) -> None: ...
    def release(self, match: Match) -> None: ...
    def shared(self, handle: GenerationHandle) -> None: ...


@dataclass
class KVTiers:
    """The prefix cache's KV on the engine side; it outlives engine threads.

    ``memory`` holds the snapshots; ``disk`` (None: no disk tier) writes new
    blocks to files, and ``on_disk`` names the blocks written or found there
    (so a block is spilled once)."""

    memory: KVStore = field(default_factory=KVStore)
    disk: DiskWriter | None = None
    on_disk: set[bytes] = field(default_factory=set)
    directory: Path | None = None

    def open_disk(
        self,
        base: Path,
        fingerprint: str,
        owner: str,
        written: Callable[[bytes, int | None], None],
    ) -> list[tuple[bytes, int]] | None:
        """Open the disk tier for these weights under ``base`` (see
        :func:`.disk_tier.open_tier`) and start its writer; returns the blocks
        an earlier run left, or None when the directory cannot be used (the
        memory cache still works). Blocking: a listing of the directory."""
        try:
            self.directory, found = open_tier(base, fingerprint, owner)
        except OSError as exc:
            log.warning("no KV disk tier for %s in %s: %s", owner, base, exc)
            return None
        self.on_disk.update(name for name, _ in found)
        self.disk = DiskWriter(self.directory, written)
        if found:
            log.info("%s: %d KV blocks on disk from earlier runs", owner, len(found))
        return found

    def spill(self, new_blocks: list[tuple[bytes, Block]]) -> None:
        if self.disk is None:
            return
        for name, block in new_blocks:
            if name in self.on_disk or not self.disk.has_room():
                continue
            self.on_disk.add(name)
            self.disk.write(name, to_host(block.layers))

    def forget_disk(self, names: list[bytes]) -> None:
        if self.disk is None:
            return
        self.on_disk.difference_update(names)
        self.disk.delete(names)


@dataclass
class Snapshots:
    loaded: LoadedModel
    kv: KVTiers
    outbox: SnapshotOutbox
    enabled: bool
    next_entry_id: Callable[[], int]
    # Sharded across ranks: a snapshot that cannot be kept or rebuilt is an
    # error, not a cold start (the other ranks would not know).
    strict: bool = False

    # -- starting from the cache ------------------------------------------------

    def cache_for(self, handle: GenerationHandle) -> tuple[Any, int]:
        """A private cache holding ``handle``'s match: the snapshot's first
        tokens, then the blocks read from disk; and its length. (None, 0) when
        there is no match or it cannot be rebuilt (a cold start always works).
        The match is unpinned once the cache exists."""
        match = handle.match
        if match is None:
            return None, 0
        loaded, match.loaded = match.loaded or [], None  # the engine's from here on
        cache = None
        try:
            if len(loaded) == len(match.disk):
                extra = [from_host(block) for block in loaded]
                if match.entry is None:
                    cache = self.kv.memory.cache_from_blocks(extra) if extra else None
                else:
                    cache = self.kv.memory.cache_for(match.entry.id, match.memory_length, extra)
            if cache is not None and match.extent > match.length:
                cache = trimmed(cache, match.extent - match.length)
        except Exception:
            if self.strict:
                raise
            log.exception("could not rebuild a cached prefix; prefilling it again")
            cache = None
        finally:
            self.outbox.release(match)
        if cache is None and self.strict:
            raise RuntimeError(f"the prefix cache does not hold the {match.length} tokens matched")
        return (cache, match.length) if cache is not None else (None, 0)

    def boundaries(self, handle: GenerationHandle, reused: int) -> list[int]:
        """Where to snapshot a prompt whose cache cannot be trimmed, in order:
        where its system prompt ends (other conversations go on there), and
        where the conversation ends, before the template's generation prompt
        (the next turn goes on there; the snapshot at the end of the reply
        rarely matches it, since the reply is re-rendered). None for a plain
        KV cache, which is reused at any length."""
        prompt = handle.prompt
        if self.loaded.plain_kv or not self.enabled:
            return []
        found = {handle.boundary}
        for suffix in self.loaded.generation_suffixes:
            end = len(prompt) - len(suffix)
            if tuple(prompt[end:]) == suffix:
                found.add(end)
                break
        return sorted(b for b in found if reused < b < len(prompt) - 1)

    # -- keeping ------------------------------------------------------------------

    def keep(self, key: Any, cache: list[Any] | None, tokens: list[int]) -> None:
        """Hold a sequence's KV (cut into shared blocks where it can be), spill
        its new blocks to disk, and tell the index about it."""
        if not self.enabled or not cache or not tokens:
            return
        tokens = list(tokens)  # mlx-lm's list goes on growing with the sequence
        entry_id = self.next_entry_id()
        try:
            names = chain(root_name(self.loaded.fingerprint, key[1]), tokens)
            kept = self.kv.memory.keep(entry_id, cache, names, len(tokens))
            self.kv.spill(kept.new_blocks)
        except Exception:  # losing a snapshot costs a prefill, nothing else
            if self.strict:
                raise
            log.exception("could not keep a KV snapshot of %d tokens", len(tokens))
            return
        self.outbox.snapshot(
            Entry(
                entry_id,
                key,
                tokens,
                kept.own_nbytes,
                kept.trimmable,
                blocks=kept.blocks,
                block_nbytes=kept.block_nbytes,
            )
        )

    def keep_live(self, gen: Any, seq: LiveSequence) -> None:
        """Keep a running sequence's KV as it is now (``gen``: the
        ``BatchGenerator`` that runs it)."""
        try:
            extracted = gen.extract_cache([seq.uid])
        except Exception:
            if self.strict:
                raise
            log.exception("could not take a KV snapshot of a running sequence")
            return
        for cache, tokens in extracted.values():
            self.keep(seq.handle.cache_key, cache, tokens)

    def share(self, gen: Any, live: Iterable[LiveSequence]) -> None:
        """Snapshot the sequences another request waits to start from, once
        they hold the tokens it needs. (For caches that cannot be trimmed the
        wait is only ever for a cancelled prefill, which is kept as it is
        removed.)"""
        if not self.loaded.plain_kv:
            return
        for seq in live:
            if not seq.share_requested or seq.shared:
                continue
            if seq.prefilling and seq.context < seq.share_at:
                continue
            seq.shared = True
            try:
                self.keep_live(gen, seq)
            finally:
                self.outbox.shared(seq.handle)
