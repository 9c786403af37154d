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
    whole_tokens: int = 0


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

    return bool(cache) and all(
        (type(c) is KVCache or getattr(type(c), "PLAIN_KV", False)) and c.keys is not None
        for c in cache
    )


class KVStore:
    def __init__(self) -> None:
        self.blocks: dict[bytes, Block] = {}
        self.snapshots: dict[int, Snapshot] = {}

    # -- keeping ---------------------------------------------------------------

    def keep(self, entry_id: int, cache: list[Any], names: list[bytes], tokens: int) -> Kept:
        """Hold ``cache`` (of ``tokens`` tokens) as snapshot ``entry_id``;
        ``names`` are the chain names of its tokens' full blocks. Raises
        ValueError when the cache does not hold that many tokens."""
        import mlx.core as mx
        from mlx_lm.models.cache import can_trim_prompt_cache

        if not blockable(cache):
            for layer in cache:
                _own(layer)
            mx.eval([layer.state for layer in cache])
            self.snapshots[entry_id] = Snapshot((), None, 0, cache, tokens)
            nbytes = sum(c.nbytes for c in cache)
            return Kept((), [], 0, nbytes, can_trim_prompt_cache(cache))

        length = cache[0].offset
        if length != tokens:
            raise ValueError(f"a cache of {length} tokens given as {tokens}")
        names = names[: length // BLOCK_TOKENS]
        fresh: dict[bytes, Block] = {}
        for i, name in enumerate(names):
            if name not in self.blocks and name not in fresh:
                fresh[name] = self._cut(cache, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
        start = len(names) * BLOCK_TOKENS
        tail = _slice(cache, start, length) if length > start else None
        mx.eval([block.layers for block in fresh.values()], tail or [])
        # Nothing below can fail: the reference counts never count a snapshot
        # that was not kept.
        for name in names:
            block = self.blocks.setdefault(name, fresh.get(name))  # type: ignore[arg-type]
            block.refs += 1
        new = list(fresh.items())
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
            if extra:
                return None
            return trimmed(copy.deepcopy(snapshot.whole), snapshot.whole_tokens - length)
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
        return trimmed(_joined(parts), covered - length)

    def cache_from_blocks(self, extra: list[Layers]) -> list[Any]:
        """A private cache made of ``extra`` blocks alone (read from disk)."""
        return _joined(extra)


def _slice(cache: list[Any], start: int, end: int) -> Layers:
    import mlx.core as mx

    # mx.array copies; a slice (mx.contiguous of one, and copy.deepcopy) may
    # stay a view that keeps the whole batch's buffer alive.
    return [
        (mx.array(c.keys[..., start:end, :]), mx.array(c.values[..., start:end, :])) for c in cache
    ]


def _own(cache: Any) -> None:
    """Replace every array ``cache`` holds (nested caches included) by a copy,
    so that a snapshot extracted from a batch holds its own memory."""
    import mlx.core as mx

    def copied(value: Any) -> Any:
        if isinstance(value, mx.array):
            return mx.array(value)
        if isinstance(value, list | tuple) and any(isinstance(v, mx.array) for v in value):
            return type(value)(copied(v) for v in value)
        return value

    for name, value in list(vars(cache).items()):
        if (
            isinstance(value, list | tuple)
            and value
            and all(hasattr(v, "__dict__") and not isinstance(v, mx.array) for v in value)
        ):
            for inner in value:  # CacheList: caches inside
                _own(inner)
            continue
        setattr(cache, name, copied(value))


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


def trimmed(cache: list[Any], excess: int) -> list[Any] | None:
    """``cache`` without its last ``excess`` tokens (None: it cannot be trimmed)."""
    from mlx_lm.models.cache import trim_prompt_cache

    if excess > 0 and trim_prompt_cache(cache, excess) != excess:
        return None
    return cache


def _nbytes(layers: Layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)
