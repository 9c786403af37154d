"""Decode speed of ``BatchGenerator`` as the engine drives it, for the
logits-processor benchmarks."""

from __future__ import annotations

import time
from typing import Any


def decode_tps(
    model: Any,
    prompt: list[int],
    batch: int,
    tokens: int,
    processors: list[list[Any]] | None,
    seen: list[list[int]],
) -> float:
    """Decode tokens/s of ``batch`` copies of ``prompt`` for ``tokens`` tokens
    each (timed from the first token on: prefill excluded). ``seen`` gets each
    sequence's tokens as the host receives them, as the engine keeps them."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=tokens, stop_tokens=[], completion_batch_size=batch)
    uids = gen.insert([prompt] * batch, [tokens] * batch, logits_processors=processors)
    index = {uid: i for i, uid in enumerate(uids)}
    count, started = 0, None
    try:
        while responses := gen.next_generated():
            for r in responses:
                seen[index[r.uid]].append(r.token)
            if started is None:
                started = time.perf_counter()
                continue
            count += len(responses)
    finally:
        gen.close()
    assert started is not None
    return count / (time.perf_counter() - started)
