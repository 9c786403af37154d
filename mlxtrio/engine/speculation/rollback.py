"""A batch KV cache whose rows end where each one's tokens end, so that each
row can be rolled back on its own (engine thread).

mlx-lm's ``BatchKVCache`` left-pads its rows so that all of them end at one
write index, and ``trim(n)`` takes the same ``n`` tokens off every row. After a
verification step each row keeps its own number of the tokens just written:
making them end together again would move every row's whole history (a copy of
the cache per step, measured at several times a decode step's cost on a long
context). :class:`RaggedBatchKVCache` instead remembers each row's own end:
a step writes each row's tokens at its own end, the mask lets each query see
its row from its left padding up to itself, and :meth:`trim_rows` only moves
the ends back. What lies past a row's end is never attended to and is
overwritten by its next tokens.

It subclasses mlx-lm's class and overrides what depends on the common end
(a change small enough to offer upstream as per-row ends in ``BatchKVCache``).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


def model_rolls_back(model: Any) -> bool:
    """Whether every layer of ``model``'s batch cache is plain attention KV
    (mlx-lm's ``KVCache``, batched as ``BatchKVCache``): rotating windows and
    recurrent state cannot give tokens back."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


class RaggedBatchKVCache(BatchKVCache):
    """``BatchKVCache`` with an end per row (``ends``, on the host).

    ``_idx`` stays the longest row's end, so ``keys_and_values`` covers every
    row; ``offset`` (each row's RoPE position: its length, plus an M-RoPE
    row's delta, see ..vision) moves with ``ends``."""

    ends: list[int]
    keys: Any  # mx.array once a row was written (None in the base class's __init__)
    values: Any

    @classmethod
    def of(cls, cache: BatchKVCache) -> RaggedBatchKVCache:
        """``cache``'s state (not copied) in a ragged cache, every row ending at its index."""
        ragged = cls.__new__(cls)
        ragged.keys, ragged.values = cache.keys, cache.values
        ragged.offset, ragged.left_padding = cache.offset, cache.left_padding
        ragged._idx, ragged._right_padding = cache._idx, None
        ragged.ends = [cache._idx] * int(cache.offset.shape[0])
        return ragged

    @property
    def even(self) -> bool:
        return all(end == self._idx for end in self.ends)

    def trim_rows(self, counts: list[int]) -> None:
        """Take the last ``counts[i]`` tokens off row ``i``."""
        self.ends = [end - n for end, n in zip(self.ends, counts, strict=True)]
        self.offset = self.offset - mx.array(counts)
        self._idx = max(self.ends, default=0)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.even:
            fetched = super().update_and_fetch(keys, values)
            self.ends = [self._idx] * len(self.ends)
            return fetched
        n = keys.shape[2]
        top = max(self.ends) + n
        if top > self.keys.shape[2]:
            self._grow(top, keys, values)
        for row, end in enumerate(self.ends):
            self.keys[row : row + 1, :, end : end + n] = keys[row : row + 1]
            self.values[row : row + 1, :, end : end + n] = values[row : row + 1]
        self.ends = [end + n for end in self.ends]
        self.offset = self.offset + n
        self._idx = top
        return self.keys_and_values()

    def _grow(self, top: int, keys: mx.array, values: mx.array) -> None:
        steps = (top + self.step - 1) // self.step
        size = steps * self.step - self.keys.shape[2]
        batch, heads, _, key_dim = keys.shape
        new_k = mx.zeros((batch, heads, size, key_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, size, values.shape[3]), values.dtype)
        self.keys = mx.concatenate([self.keys, new_k], axis=2)
        self.values = mx.concatenate([self.values, new_v], axis=2)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if self.even:
            return super().make_mask(N, return_array=return_array, **kwargs)
        # Query j of row i stands at ends[i] + j and sees its row from the
        # left padding up to itself.
        columns = mx.arange(max(self.ends) + N)[None, None, :]
        queries = mx.array(self.ends)[:, None, None] + mx.arange(N)[None, :, None]
        padding = self.left_padding[:, None, None]
        return ((columns >= padding) & (columns <= queries))[:, None]

    def filter(self, batch_indices: Any) -> None:
        indices = [int(i) for i in batch_indices]
        padding = cast(list[int], self.left_padding.tolist())
        lowest = min((padding[i] for i in indices), default=0)
        ends = [self.ends[i] - lowest for i in indices]
        super().filter(batch_indices)
        self.ends = ends
        self._idx = max(ends, default=0)

    def extend(self, other: BatchKVCache) -> None:
        ends = getattr(other, "ends", None) or [other._idx] * int(other.offset.shape[0])
        top = max(self._idx, other._idx)
        mine = [end + top - self._idx for end in self.ends]
        theirs = [end + top - other._idx for end in ends]
        super().extend(other)
        self.ends = mine + theirs

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()
        start, end = cast(int, self.left_padding[idx].item()), self.ends[idx]
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, start:end])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, start:end])
        cache.offset = end - start
        return cache


def ragged(cache: list[Any]) -> list[Any]:
    """``cache``'s layers as ragged caches (already ragged layers unchanged)."""
    return [
        layer if isinstance(layer, RaggedBatchKVCache) else RaggedBatchKVCache.of(layer)
        for layer in cache
    ]


def trim_rows(cache: list[Any], counts: list[int]) -> None:
    """Take the last ``counts[i]`` tokens off row ``i`` of every layer."""
    if any(counts):
        for layer in cache:
            layer.trim_rows(counts)
