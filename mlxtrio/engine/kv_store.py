"""The prefix cache's KV, held on the engine thread: shared blocks and private tails.

A snapshot of a plain attention cache (every layer an mlx-lm ``KVCache``) is cut
into named blocks (:mod:`.blocks`) and a *tail*, the tokens after its last full
block. Blocks are held once however many snapshots name them and are freed when
the last snapshot naming them is dropped; each block is its own copied arrays,
so a dropped sequence's batch buffers are never kept alive by a slice, and the
bytes counted are the bytes held.

Caches that cannot be cut (sliding-window or recurrent layers, quantized KV)
are held whole and only ever reused at their exact length.

Engine thread only: everything here creates or frees MLX arrays.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .blocks import BLOCK_TOKENS

Layers = list[tuple[Any, Any]]  # per layer: (keys, values), each [1, heads, tokens, dim]


@dataclass
class Block:
    layers: Layers
    nbytes: int
    refs: int = 0


@dataclass
class Snapshot:
    """One cached sequence: named blocks, then a tail of ``tail_tokens`` tokens;
    or, for a cache that cannot be cut, the whole cache."""

    blocks: tuple[bytes, ...]
    tail: Layers | None
    tail_tokens: int
    whole: list[Any] | None = None


@dataclass
class Kept:
    """What :meth:`KVStore.keep` made of a cache, for the index to account."""

    blocks: tuple[bytes, ...]
    new_blocks: list[tuple[bytes, Block]]  # created by this snapshot (to spill to disk)
    block_nbytes: int  # of one full block
    own_nbytes: int  # the tail's (or the whole cache's) bytes
    trimmable: bool


def blockable(cache: list[Any]) -> bool:
    """Whether ``cache`` can be cut into blocks: every layer a filled ``KVCache``."""
    from mlx_lm.models.cache import KVCache

    return bool(cache) and all(type(c) is KVCache and c.keys is not None for c in cache)


class KVStore:
    def __init__(self) -> None:
        self.blocks: dict[bytes, Block] = {}
        self.snapshots: dict[int, Snapshot] = {}

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self.snapshots

    # -- keeping ---------------------------------------------------------------

    def keep(self, entry_id: int, cache: list[Any], names: list[bytes]) -> Kept:
        """Hold ``cache`` as snapshot ``entry_id``; ``names`` are the chain names
        of its tokens' full blocks."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        if not blockable(cache):
            self.snapshots[entry_id] = Snapshot((), None, 0, whole=cache)
            nbytes = sum(c.nbytes for c in cache)
            return Kept((), [], 0, nbytes, can_trim_prompt_cache(cache))
        import mlx.core as mx

        length = cache[0].offset
        names = names[: length // BLOCK_TOKENS]
        new: list[tuple[bytes, Block]] = []
        for i, name in enumerate(names):
            block = self.blocks.get(name)
            if block is None:
                block = self._cut(cache, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
                self.blocks[name] = block
                new.append((name, block))
            block.refs += 1
        start = len(names) * BLOCK_TOKENS
        tail = _slice(cache, start, length) if length > start else None
        mx.eval([block.layers for _, block in new], tail or [])
        self.snapshots[entry_id] = Snapshot(tuple(names), tail, length - start)
        block_nbytes = _nbytes(new[0][1].layers) if new else self._block_nbytes(names)
        return Kept(tuple(names), new, block_nbytes, _nbytes(tail or []), True)

    def _cut(self, cache: list[Any], start: int, end: int) -> Block:
        layers = _slice(cache, start, end)
        return Block(layers, _nbytes(layers))

    def _block_nbytes(self, names: list[bytes]) -> int:
        return self.blocks[names[0]].nbytes if names else 0

    def drop(self, entry_id: int) -> None:
        snapshot = self.snapshots.pop(entry_id, None)
        if snapshot is None:
            return
        for name in snapshot.blocks:
            block = self.blocks[name]
            block.refs -= 1
            if block.refs == 0:
                del self.blocks[name]

    # -- reuse -----------------------------------------------------------------

    def cache_for(self, entry_id: int, length: int, extra: list[Layers] = ()) -> list[Any] | None:  # type: ignore[assignment]
        """A private cache holding the first ``length`` tokens of snapshot
        ``entry_id`` followed by the ``extra`` blocks (read from disk); None when
        the snapshot is gone or cannot give that many tokens."""
        snapshot = self.snapshots.get(entry_id)
        if snapshot is None:
            return None
        if snapshot.whole is not None:
            return _trimmed(copy.deepcopy(snapshot.whole), length) if not extra else None
        wanted = -(-length // BLOCK_TOKENS)  # blocks that cover ``length``
        parts = [self.blocks[name].layers for name in snapshot.blocks[:wanted]]
        covered = len(parts) * BLOCK_TOKENS
        if covered < length and snapshot.tail is not None:
            parts.append(snapshot.tail)
            covered += snapshot.tail_tokens
        if extra:
            if covered != length:  # disk blocks follow whole memory blocks only
                return None
            parts.extend(extra)
            covered += len(extra) * BLOCK_TOKENS
            length = covered
        if covered < length:
            return None
        return _trimmed(_joined(parts), covered - length)

    def cache_from_blocks(self, extra: list[Layers]) -> list[Any]:
        """A private cache made of ``extra`` blocks alone (read from disk)."""
        return _joined(extra)


def _slice(cache: list[Any], start: int, end: int) -> Layers:
    import mlx.core as mx

    return [
        (
            mx.contiguous(c.keys[..., start:end, :]),
            mx.contiguous(c.values[..., start:end, :]),
        )
        for c in cache
    ]


def _joined(parts: list[Layers]) -> list[Any]:
    """One ``KVCache`` per layer holding ``parts`` one after the other."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = []
    for layer in range(len(parts[0])):
        cache = KVCache()
        cache.keys = mx.concatenate([part[layer][0] for part in parts], axis=2)
        cache.values = mx.concatenate([part[layer][1] for part in parts], axis=2)
        cache.offset = cache.keys.shape[2]
        caches.append(cache)
    return caches


def _trimmed(cache: list[Any], excess: int) -> list[Any] | None:
    from mlx_lm.models.cache import trim_prompt_cache

    if excess > 0 and trim_prompt_cache(cache, excess) != excess:
        return None
    return cache


def _nbytes(layers: Layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)
