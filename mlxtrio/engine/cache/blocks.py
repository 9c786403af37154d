"""Block identities for the prefix cache: fixed runs of tokens named by a hash chain.

A prompt's KV is cut into blocks of :data:`BLOCK_TOKENS` tokens. Block *i* is
named by a hash of block *i-1*'s name and its own tokens, starting from a root
that names the model (its weights and compute type) and the isolation domain.
Two conversations that share a system prompt therefore share the names of its
blocks, and hold them once; a name also says everything needed to find the
block again on disk after a restart, and never matches across models or
domains.

Pure Python, no MLX: the Trio thread computes chains for lookups (a 35k-token
prompt is 137 hashes of 1 KiB each, well under a millisecond).
"""

from __future__ import annotations

import hashlib
import sys
from array import array

from ..types import BLOCK_TOKENS

HASH_BYTES = 16


def root_name(fingerprint: str, domain: str) -> bytes:
    """The chain's start for one model (``fingerprint``) and isolation domain."""
    return hashlib.blake2b(
        f"{fingerprint}\0{domain}".encode(), digest_size=HASH_BYTES, person=b"mlxtrio-root"
    ).digest()


def chain(
    root: bytes, tokens: list[int], start: int = 0, previous: bytes | None = None
) -> list[bytes]:
    """Names of the full blocks of ``tokens``, from block ``start`` on
    (``previous``: the name of block ``start - 1``; the root when ``start`` is 0)."""
    name = root if previous is None else previous
    names = []
    for begin in range(start * BLOCK_TOKENS, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        run = array("q", tokens[begin : begin + BLOCK_TOKENS])
        if sys.byteorder == "big":  # names are the same on every machine
            run.byteswap()
        name = hashlib.blake2b(name + run.tobytes(), digest_size=HASH_BYTES).digest()
        names.append(name)
    return names
