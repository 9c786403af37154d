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


LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def _only(token: int, logits: mx.array) -> mx.array:
    allowed = mx.arange(logits.shape[-1]) == token
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def forced_tokens_processor(tokens: tuple[int, ...], after: int | None) -> LogitsProcessor:
    """Make the next generated tokens exactly ``tokens``: from the first step, or
    from the step after ``after`` was generated (if it never is, nothing is forced)."""
    state = {"step": 0, "armed": after is None, "next": 0}

    def process(context: mx.array, logits: mx.array) -> mx.array:
        step = state["step"]
        state["step"] = step + 1
        if state["next"] >= len(tokens):
            return logits
        if not state["armed"]:
            if step == 0 or context[-1].item() != after:
                return logits
            state["armed"] = True
        token = tokens[state["next"]]
        state["next"] += 1
        return _only(token, logits)

    return process


def reasoning_budget_processor(budget: int, think_end_id: int) -> LogitsProcessor:
    """Force the end-of-reasoning token once ``budget`` tokens were generated
    without it. Called once per decode step with the token context (whose last
    entry is the token sampled at the previous step) and that step's logits."""
    state = {"step": 0, "closed": False}

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        step = state["step"]
        state["step"] = step + 1
        if state["closed"]:
            return logits
        if step > 0 and tokens[-1].item() == think_end_id:
            state["closed"] = True
            return logits
        if step < budget:
            return logits
        state["closed"] = True
        return _only(think_end_id, logits)

    return process
