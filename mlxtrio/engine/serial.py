"""Vision-language models generated one sequence at a time: those whose
language model attends to images by cross-attention (mllama: Llama 3.2 Vision).

mllama keeps one ``<|image|>`` token per image in the prompt; its
cross-attention layers read the images' features (the vision tower's output)
at every step, prefill and decode alike, and no KV cache holds them. A batch
row would need its own features in every cross-attention layer, which neither
mlx-lm's batched caches nor mlx-vlm's model provide; and as every token's KV
depends on the images (the text before an image token too), a prefix cache
keyed by tokens cannot reuse it either. So these models run on a serial path:

* :class:`CrossAttentionModel` is mlx-vlm's model with the two calls the path
  needs: the images' features and masks (:meth:`~CrossAttentionModel.attend`)
  and a forward pass over a run of tokens. A prompt without images skips the
  cross-attention layers, as transformers' mllama does (mlx-vlm's would run
  them on the text itself).
* :class:`SerialGenerator` stands in for mlx-lm's ``BatchGenerator`` in the
  engine loop: the same insert, step, remove and stats calls, so commands,
  safepoints, admission, cancellation and events are the text path's. It runs
  the oldest sequence alone (its prefill in paced chunks, then one token per
  step) while later ones wait in its queue.

The loop turns the prefix cache off for these models, and speculation.
Engine thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .image_tokens import VisionPrompt

# mlx-vlm architectures served on this path (model_type in config.json).
SERIAL_TYPES = frozenset({"mllama"})


class CrossKV:
    """One cross-attention layer's keys and values of a sequence's images,
    projected once. mlx-vlm's layer reads them through ``fetch`` when it is
    given no features and its cache says it holds some (``offset``): without
    this it would project every image token again at every generated token
    (for Llama 3.2 Vision with one 4-tile image, ~40x the rest of a step)."""

    offset = 1

    def __init__(self, keys: mx.array, values: mx.array) -> None:
        self.keys, self.values = keys, values

    def fetch(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values


@dataclass(frozen=True)
class Features:
    """A prompt's images as its cross-attention layers read them: each
    layer's keys and values (by layer index), and which prompt rows see which
    image (``mask``; ``rows`` zeroes the rows that see none, the text before
    the first image)."""

    kv: dict[int, CrossKV]
    mask: mx.array
    rows: mx.array

    def at(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        return self.mask[:, :, start:end], self.rows[:, :, start:end]


class CrossAttentionModel(nn.Module):
    """mlx-vlm's mllama as the serial path calls it."""

    serial = True  # see .loop: no batch, no prefix cache, no speculation

    def __init__(self, vlm: Any, processor: Any) -> None:
        super().__init__()
        self.vlm = vlm
        self.processor = processor  # a plain attribute: not one of the module's children
        config = vlm.config
        self.image_token = int(config.image_token_index)
        self.cross_layers = frozenset(config.text_config.cross_attention_layers)
        self.max_tiles = int(config.vision_config.max_num_tiles)

    @property
    def language(self) -> Any:
        return self.vlm.language_model

    @property
    def layers(self) -> Any:
        return self.language.model.layers

    def make_cache(self) -> list[Any]:
        from mlx_vlm.models.cache import make_prompt_cache

        return list(make_prompt_cache(self.language))

    def attend(self, prompt: list[int], vision: VisionPrompt) -> Features:
        """Run the vision tower over ``vision``'s images; ``prompt`` is the
        model's ids (one image token per image, in order)."""
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        arrays = [span.arrays for span in vision.spans]

        def joined(name: str) -> mx.array:
            return mx.array(np.concatenate([a[name] for a in arrays], axis=1))

        tiles = [[int(np.asarray(a["num_tiles"]).reshape(-1)[0]) for a in arrays]]
        spans = get_cross_attention_token_mask(prompt, self.image_token)
        dense = convert_sparse_cross_attention_mask_to_dense(
            [spans], tiles, self.max_tiles, len(prompt)
        )
        dtype = self.vlm.multi_modal_projector.weight.dtype
        found = self.vlm.get_input_embeddings(
            mx.array([prompt]),
            joined("pixel_values").astype(dtype),
            aspect_ratio_ids=joined("aspect_ratio_ids"),
            aspect_ratio_mask=joined("aspect_ratio_mask"),
            cross_attention_mask=mx.array(dense),
        )
        states = found.cross_attention_states
        kv = {i: self._project(self.layers[i].cross_attn, states) for i in self.cross_layers}
        return Features(kv, found.cross_attention_mask, found.full_text_row_masked_out_mask)

    @staticmethod
    def _project(attention: Any, states: mx.array) -> CrossKV:
        """What mlx-vlm's ``MllamaTextCrossAttention`` computes from the image
        features for its keys and values."""
        heads, dim = attention.num_key_value_heads, attention.head_dim

        def split(x: mx.array) -> mx.array:
            return x.reshape(1, -1, heads, dim).transpose(0, 2, 1, 3)

        keys = attention.k_norm(split(attention.k_proj(states)))
        return CrossKV(keys, split(attention.v_proj(states)))

    def forward(
        self, tokens: list[int], cache: list[Any], features: Features | None, start: int
    ) -> mx.array:
        """Logits after each of ``tokens``, which stand at ``start`` in the
        sequence (past the prompt: the mask rows are the prompt's last, as a
        generated token sees what the prompt's end saw)."""
        ids = mx.array([tokens])
        if features is None:
            return self._text(ids, cache)
        rows = features.mask.shape[2]
        mask, keep = features.at(min(start, rows - 1), min(start + len(tokens), rows))
        layers = [features.kv.get(i, c) for i, c in enumerate(cache)]
        out = self.language(
            inputs=ids,
            cache=layers,
            cross_attention_mask=mask,
            full_text_row_masked_out_mask=keep,
        )
        return out.logits

    def _text(self, ids: mx.array, cache: list[Any]) -> mx.array:
        from mlx_vlm.models.base import create_attention_mask

        model = self.language.model
        hidden = model.embed_tokens(ids)
        first = next(i for i in range(len(cache)) if i not in self.cross_layers)
        mask = create_attention_mask(hidden, cache[first])
        for i, (layer, layer_cache) in enumerate(zip(model.layers, cache, strict=True)):
            if i not in self.cross_layers:
                hidden = layer(hidden, mask=mask, cache=layer_cache)
        return self.language.lm_head(model.norm(hidden))


# mlx-lm's samplers and logits processors, as the loop hands them over.
Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass(eq=False)
class _Sequence:
    uid: int
    prompt: list[int]  # the model's ids
    vision: VisionPrompt | None
    max_tokens: int
    sampler: Sampler
    processors: list[Processor]
    matcher: Any  # mlx-lm's StopSequences.Matcher
    cache: list[Any]
    features: Features | None = None
    tokens: list[int] = field(default_factory=list)  # in the cache
    pending: int | None = None  # sampled, not yet in the cache
    generated: int = 0


@dataclass
class _Timing:
    """What :meth:`SerialGenerator.stats` reports (mlx-lm's ``BatchStats`` fields the loop reads)."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0


@dataclass
class _PromptResponse:  # mlx-lm's PromptProcessingBatch.Response
    uid: int
    progress: tuple[int, int]
    end_of_segment: bool
    end_of_prompt: bool


@dataclass
class _TokenResponse:  # mlx-lm's GenerationBatch.Response
    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list[Any] | None
    all_tokens: list[int] | None


class SerialGenerator:
    """mlx-lm's ``BatchGenerator`` calls, one sequence at a time (see the
    module docstring). A finished sequence's cache is dropped: nothing is kept
    for reuse."""

    def __init__(self, model: CrossAttentionModel, max_tokens: int, prefill_step_size: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.prefill_step_size = prefill_step_size  # the loop sets it per step
        # (uid, sequence) in arrival order; the names are BatchGenerator's, which
        # .batch's drop_queued and hand_over_queue reach into.
        self._unprocessed_sequences: deque[tuple[int, _Sequence]] = deque()
        self._uid_count = 0
        self._active: _Sequence | None = None
        self._totals = _Timing()

    def add(
        self,
        prompt: list[int],
        vision: VisionPrompt | None,
        max_tokens: int | None,
        sampler: Sampler,
        processors: Sequence[Processor],
        stops: Any,
    ) -> int:
        """Queue one sequence (``prompt`` as the handle holds it: key tokens
        where its images stand); its uid."""
        if not prompt:
            raise ValueError("the prompt is empty")
        limit = self.max_tokens if max_tokens is None else max_tokens
        if limit <= 0:
            raise ValueError("max_tokens must be > 0")
        uid = self._uid_count
        self._uid_count += 1
        ids = vision.model_tokens(prompt) if vision is not None else list(prompt)
        seq = _Sequence(
            uid,
            ids,
            vision,
            limit,
            sampler,
            list(processors),
            stops.matcher(),
            self.model.make_cache(),
        )
        self._unprocessed_sequences.append((uid, seq))
        return uid

    def next(self) -> tuple[list[_PromptResponse], list[_TokenResponse]]:
        """One step of the oldest sequence: a prefill chunk (the last one
        samples its first token), or one generated token."""
        seq = self._active
        if seq is None:
            if not self._unprocessed_sequences:
                return [], []
            _, seq = self._unprocessed_sequences.popleft()
            self._active = seq
        if seq.pending is None:
            return self._prefill(seq)
        return [], [self._decode(seq)]

    def _prefill(self, seq: _Sequence) -> tuple[list[_PromptResponse], list[_TokenResponse]]:
        if seq.features is None and seq.vision is not None:
            # The vision tower: once, at the first chunk, outside the
            # prefill's timing (the pacer learns the text's speed).
            seq.features = self.model.attend(seq.prompt, seq.vision)
            features = seq.features
            mx.eval([kv.fetch() for kv in features.kv.values()], features.mask, features.rows)
        started = time.perf_counter()
        start = len(seq.tokens)
        end = min(len(seq.prompt), start + max(1, self.prefill_step_size))
        chunk = seq.prompt[start:end]
        logits = self.model.forward(chunk, seq.cache, seq.features, start)
        seq.tokens.extend(chunk)
        done = end == len(seq.prompt)
        tokens: list[_TokenResponse] = []
        if done:
            tokens.append(self._sampled(seq, logits[:, -1, :]))
        else:
            mx.eval(logits[:, -1, :], [c.state for c in seq.cache if c.offset])
        self._totals.prompt_tokens += len(chunk)
        self._totals.prompt_time += time.perf_counter() - started
        prompt = _PromptResponse(seq.uid, (end, len(seq.prompt)), done, done)
        return [prompt], tokens

    def _decode(self, seq: _Sequence) -> _TokenResponse:
        assert seq.pending is not None
        token = seq.pending
        logits = self.model.forward([token], seq.cache, seq.features, len(seq.tokens))
        seq.tokens.append(token)
        return self._sampled(seq, logits[:, -1, :])

    def _sampled(self, seq: _Sequence, logits: mx.array) -> _TokenResponse:
        """Sample the next token (the sequence's processors first) and say
        whether the sequence ends with it, as mlx-lm's batch does."""
        if seq.processors:
            context = mx.array(seq.tokens)
            for processor in seq.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = seq.sampler(logprobs)
        mx.eval(sampled, logprobs)
        token = cast(int, sampled.item())
        seq.generated += 1
        reason = None
        if seq.generated >= seq.max_tokens:
            reason = "length"
        if seq.matcher.advance(token):
            reason = "stop"
        if reason is None:
            seq.pending = token
            return _TokenResponse(seq.uid, token, logprobs[0], None, None, None)
        self._end_active()
        return _TokenResponse(seq.uid, token, logprobs[0], reason, None, seq.tokens)

    def _end_active(self) -> None:
        """Drop the running sequence's cache and image features, and give
        their buffers back (the next sequence may be waiting, so the loop does
        not go idle, where it would)."""
        self._active = None
        mx.clear_cache()

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """Drop sequences, queued or running; nothing is kept (no prefix reuse)."""
        gone = set(uids)
        self._unprocessed_sequences = deque(
            item for item in self._unprocessed_sequences if item[0] not in gone
        )
        if self._active is not None and self._active.uid in gone:
            self._end_active()
        return {}

    @contextmanager
    def stats(self) -> Iterator[_Timing]:
        """The prefill work done while the block runs."""
        before = _Timing(self._totals.prompt_tokens, self._totals.prompt_time)
        timing = _Timing()
        try:
            yield timing
        finally:
            timing.prompt_tokens = self._totals.prompt_tokens - before.prompt_tokens
            timing.prompt_time = self._totals.prompt_time - before.prompt_time

    def close(self) -> None:
        self._active = None
