"""Prompt-lookup drafts for one sequence: what came after the latest earlier
occurrence of its last few tokens.

Agents' output copies what they were shown (an Edit call repeats the lines it
replaces, a patch its context lines, a rewrite the file it read), so the
continuation of the longest recent n-gram match is often exactly what the model
says next. No model runs here: a dict per n-gram size maps each n-gram to where
the token after its latest occurrence stands.

Memory is bounded: only the last :data:`WINDOW` tokens are indexed, the
prompt's n-grams in sorted numpy arrays (16 bytes an entry: ~1.5 MB for a
32k-token prompt, a tenth of what dicts take), the output's in dicts; all is
rebuilt from the window when it has grown to twice that. No MLX.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from ..image_tokens import KEY_BASE

WINDOW = 32768  # tokens indexed per sequence (prompt tail and output)
NGRAM_SIZES = (4, 3, 2)  # tried longest first
_MULTIPLIER = 1_000_003  # n-gram keys: a polynomial over the token ids (int64, wrapping)


class PromptLookup:
    """The n-gram index of one sequence's tokens so far.

    ``append`` takes in every token the sequence's KV cache takes in (prompt,
    then output, in order); ``propose`` reads the continuation of the current
    suffix. A key collision only costs a rejected draft: verification is exact.
    """

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens: list[int] = []
        self._base = 0  # absolute position of self._tokens[0]
        # Per n-gram size: the indexed prompt (sorted keys, the position after
        # each key's latest occurrence), then a dict of what came since.
        self._static: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._index: dict[int, dict[int, int]] = {n: {} for n in NGRAM_SIZES}
        self._build(list(tokens[-WINDOW:]))

    def __len__(self) -> int:
        return self._base + len(self._tokens)

    def append(self, tokens: Iterable[int]) -> None:
        """Take in ``tokens``, the next ones of the sequence."""
        for token in tokens:
            self._tokens.append(token)
            end = len(self._tokens) - 1  # the n-gram ending before ``token`` now has a successor
            for n, index in self._index.items():
                if end >= n:
                    index[_key(self._tokens[end - n : end])] = self._base + end
        if len(self._tokens) >= 2 * WINDOW:
            kept = self._tokens[-WINDOW:]
            self._base += len(self._tokens) - WINDOW
            self._build(kept)

    def propose(self, limit: int, pending: Sequence[int] = ()) -> list[int]:
        """Up to ``limit`` tokens that may follow the sequence and then
        ``pending`` (tokens about to be taken in, not yet appended); [] when
        no suffix of it occurred before."""
        if limit <= 0:
            return []
        tail = self._tokens[-NGRAM_SIZES[0] :] + list(pending)
        for n, index in self._index.items():
            if len(tail) < n:
                continue
            key = _key(tail[-n:])
            at = index.get(key)
            if at is None:
                at = self._static_find(n, key)
            if at is None or at < self._base:
                continue
            start = at - self._base
            known = self._tokens[start : start + limit]
            draft = (known + list(pending))[:limit] if len(known) < limit else known
            # An image's run is key tokens in the history (see
            # ..image_tokens): ids the model has no embedding for.
            return list(itertools.takewhile(lambda token: token < KEY_BASE, draft))
        return []

    def _static_find(self, n: int, key: int) -> int | None:
        keys, ends = self._static[n]
        at = int(np.searchsorted(keys, key))
        return int(ends[at]) if at < len(keys) and keys[at] == key else None

    def _build(self, tokens: list[int]) -> None:
        self._tokens = tokens
        ids = np.asarray(tokens, dtype=np.int64)
        for n, index in self._index.items():
            index.clear()
            count = max(len(ids) - n, 0)
            # The n-gram ending at ``end`` (exclusive), for every end with a
            # successor, keyed as _key does (int64 arithmetic wraps alike).
            keys = np.zeros(count, dtype=np.int64)
            for j in range(n):
                keys = keys * _MULTIPLIER + ids[j : j + count]
            ends = np.arange(n, n + count, dtype=np.int64) + self._base
            # Sorted by key, the latest occurrence of each key kept.
            order = np.lexsort((ends, keys))
            keys, ends = keys[order], ends[order]
            last = np.ones(count, dtype=bool)
            last[:-1] = keys[1:] != keys[:-1]
            self._static[n] = (keys[last], ends[last])


def _key(ngram: Sequence[int]) -> int:
    """The key :meth:`PromptLookup._build` computes for ``ngram`` (int64 wrapping)."""
    key = 0
    for token in ngram:
        key = (key * _MULTIPLIER + token) & 0xFFFFFFFFFFFFFFFF
    return key - (1 << 64) if key >= 1 << 63 else key
