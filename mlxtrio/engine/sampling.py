"""Samplers for :class:`mlx_lm.generate.BatchGenerator`, built from mlx-lm's parts.

Runs on the engine thread only. Requests with equal parameters share one sampler
object, which lets ``BatchGenerator`` sample the whole batch in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from .types import SamplingParams

Sampler = Callable[[mx.array], mx.array]


@lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, top_k: int, min_p: float) -> Sampler:
    return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)


def _seeded_sampler(params: SamplingParams) -> Sampler:
    """A sampler with its own PRNG stream, so a seed reproduces one request's
    output whatever else is in the batch (mlx-lm's samplers use the global key)."""
    key = mx.random.key(params.seed or 0)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        return mx.random.categorical(logprobs * (1 / params.temperature), key=sub)

    return sample


def sampler_for(params: SamplingParams) -> Sampler:
    if params.temperature > 0 and params.seed is not None:
        return _seeded_sampler(params)
    temperature = max(params.temperature, 0.0)
    top_p = params.top_p if 0 < params.top_p < 1.0 else 0.0
    return _shared_sampler(temperature, top_p, params.top_k, params.min_p)
