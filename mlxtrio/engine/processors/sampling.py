"""Samplers and penalty processors for :class:`mlx_lm.generate.BatchGenerator`,
built from mlx-lm's parts.

Runs on the engine thread only. Requests with equal parameters share one sampler
object, which lets ``BatchGenerator`` sample the whole batch in one call. Values
that are valid on the wire but not for mlx-lm are mapped here, so no request can
make a sampler raise inside a batch step: ``top_k`` at or above the vocabulary
means no top-k at all, and any 64-bit seed becomes a valid PRNG key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_sampler,
)

from ..types import SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

_KEY_SPACE = 1 << 64  # mx.random.key takes an unsigned 64-bit seed


def normalized(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """``params`` with ``top_k`` and ``seed`` brought into what mlx-lm accepts."""
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    seed = None if params.seed is None else params.seed % _KEY_SPACE
    if (top_k, seed) == (params.top_k, params.seed):
        return params
    return replace(params, top_k=top_k, seed=seed)


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
    """The sampler for already :func:`normalized` parameters."""
    if params.temperature > 0 and params.seed is not None:
        return _seeded_sampler(params)
    temperature = max(params.temperature, 0.0)
    top_p = params.top_p if 0 < params.top_p < 1.0 else 0.0
    return _shared_sampler(temperature, top_p, params.top_k, params.min_p)


def penalty_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """OpenAI ``presence_penalty`` / ``frequency_penalty`` as mlx-lm processors,
    applied to the generated tokens only (as OpenAI defines them), not to the
    prompt. Lazy on the device: no step waits for them."""
    processors: list[LogitsProcessor] = []
    window = max(params.max_tokens, 1)
    if params.presence_penalty:
        processors.append(make_presence_penalty(params.presence_penalty, window))
    if params.frequency_penalty:
        processors.append(make_frequency_penalty(params.frequency_penalty, window))
    if not processors:
        return []
    return [_OverGenerated(processors)]


class _OverGenerated:
    """Run ``processors`` on the generated part of the context only.

    The context handed to a processor at step *n* ends with the token sampled at
    step *n-1*; it holds *n* generated tokens (the first step has none)."""

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self._processors = processors
        self._steps = 0

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        produced, self._steps = self._steps, self._steps + 1
        if produced == 0:
            return logits
        tail = context[-produced:]
        for processor in self._processors:
            logits = processor(tail, logits)
        return logits
