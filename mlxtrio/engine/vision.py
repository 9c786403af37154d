"""Vision-language models on the text engine: loading through mlx-vlm, the
language model as mlx-lm's ``BatchGenerator`` sees it, and the vision prefill.

A VLM serves on the same engine thread, admission lane, batch, safepoints and
prefix cache as a text model. What differs is only how a prompt's images get
into its KV cache:

* :class:`VisionPrefill` runs before the sequence joins the batch, unit by
  unit: a slice of text (sized by the prefill pacer) or one image (its vision
  tower, then the language model over its run of tokens, through mlx-vlm's
  ``get_input_embeddings``). A unit's graph is built lazily and evaluated one
  recorded layer at a time (:func:`record_layers`), as much per engine step as
  the step's prefill budget allows, so running streams wait about one layer
  for their next token and a hang-up stops the sequence at the next step.
  Images the prefix cache already holds are not encoded again: the prefill
  starts where the cached prefix ends.
* From the end of the last image on, the prompt is text: the sequence joins
  the ``BatchGenerator`` with its cache, like any prefix-cache hit.
* Qwen-VL's multimodal RoPE (M-RoPE) gives an image's tokens 3-D positions that
  advance less than one per token, so the text after it is shifted by a
  per-sequence *rope delta*. :class:`MRopeKVCache` carries it into the batched
  cache's per-row offsets, which :class:`VisionTextModel` turns into the
  position ids mlx-vlm's language model takes; a batch of rows with different
  deltas decodes in one step.

A language model that attends to images through cross-attention (mllama)
cannot join a text batch like this: it is served one sequence at a time
(:mod:`.serial`). An encoder-decoder (florence2) is served as text only (see
:func:`vision_support`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from .image_tokens import ImageSpan, ImageTokenizer, VisionPrompt
from .serial import SERIAL_TYPES, CrossAttentionModel
from .types import LoadProgress
from .weights import read_weights

log = logging.getLogger("mlxtrio.engine")

INSTALL_HINT = "pip install 'mlxtrio[vision]'"
# Checkpoints whose images are not served, and why.
_TEXT_ONLY = {
    "florence2": "an encoder-decoder with task prompts (<CAPTION>, <OCR>, ...), "
    "not a conversation model",
}


def is_vision_checkpoint(config: dict[str, Any]) -> bool:
    return "vision_config" in config


def mlx_vlm_installed() -> bool:
    return importlib.util.find_spec("mlx_vlm") is not None


def vision_support(config: dict[str, Any]) -> str | None:
    """Why a VLM checkpoint is served as text only (None: it is served with
    its images)."""
    if not mlx_vlm_installed():
        return f"mlx-vlm is not installed ({INSTALL_HINT})"
    return _TEXT_ONLY.get(config.get("model_type", ""))


def local_config(path: str) -> dict[str, Any]:
    """The checkpoint's config.json (empty when it cannot be read here)."""
    directory = Path(path)
    if not directory.is_dir():
        try:
            from mlx_lm.utils import hf_repo_to_path

            directory = hf_repo_to_path(path)
        except Exception:
            return {}
    try:
        return cast(dict[str, Any], json.loads((directory / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


class MRopeKVCache(KVCache):
    """A ``KVCache`` that knows its sequence's M-RoPE delta; batched, the
    delta joins the row's offset (the RoPE position), never its write index."""

    rope_delta: int = 0
    # Its keys and values are a plain KVCache's: the prefix cache cuts it into
    # blocks like one (the delta is the sequence's, recomputed at reuse).
    PLAIN_KV = True

    @classmethod
    def adopt(cls, cache: Any, delta: int) -> MRopeKVCache:
        adopted = cls()
        if cache is not None:
            adopted.keys, adopted.values, adopted.offset = cache.keys, cache.values, cache.offset
        adopted.rope_delta = delta
        return adopted

    def merge(self, caches: list[Any]) -> Any:  # type: ignore[override]
        batch = BatchKVCache.merge(caches)
        deltas = mx.array([getattr(c, "rope_delta", 0) for c in caches])
        batch.offset = batch.offset + deltas
        return batch


class VisionTextModel(nn.Module):
    """mlx-vlm's language model as mlx-lm's ``BatchGenerator`` calls a model:
    ``model(tokens, cache=...)`` -> logits, with mlx-lm's cache classes."""

    def __init__(self, vlm: Any, processor: Any) -> None:
        super().__init__()
        self.vlm = vlm
        self.processor = processor  # a plain attribute: not one of the module's children
        # Qwen-VL's multimodal RoPE: positions come from the prompt's image grids.
        self.mrope = hasattr(vlm.language_model, "get_rope_index")

    @property
    def language(self) -> Any:
        return self.vlm.language_model

    @property
    def layers(self) -> Any:
        return self.language.model.layers

    def make_cache(self) -> list[Any]:
        made = getattr(self.language, "make_cache", None)
        if made is None:
            return [KVCache() for _ in self.layers]
        return [_lm_cache(c) for c in made()]

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self.mrope and cache is not None:
            kwargs["position_ids"] = _text_positions(cache[0], inputs.shape[1], inputs.shape[0])
        return self.language(inputs, cache=cache, **kwargs).logits


def _lm_cache(cache: Any) -> Any:
    """mlx-lm's cache class for one of mlx-vlm's (the batch merges mlx-lm's).
    Only attention caches are known here: a recurrent layer's state (Qwen3.5's
    Gated DeltaNet), chunked or nested caches raise ValueError, and the model
    is served by mlx-lm as text instead."""
    kind = type(cache).__name__
    if kind == "RotatingKVCache":
        return RotatingKVCache(max_size=cache.max_size, keep=getattr(cache, "keep", 0))
    if kind == "KVCache":
        return KVCache()
    raise ValueError(f"its {kind} layers are not served with images")


def _text_positions(cache: Any, length: int, rows: int) -> mx.array:
    """Text positions after a row's offset (its rope delta included), the
    same on M-RoPE's three axes."""
    offset = cache.offset
    if isinstance(offset, mx.array) and offset.ndim > 0:
        start = offset[:, None]
    else:
        start = mx.full((rows, 1), int(offset))
    positions = start + mx.arange(length)[None]
    return mx.broadcast_to(positions[None], (3, rows, length))


def read_vision_checkpoint(
    path: str, progress: LoadProgress | None = None
) -> tuple[VisionTextModel | CrossAttentionModel, Any, dict[str, Any]]:
    """A VLM checkpoint through mlx-vlm (model and processor) and mlx-lm's
    tokenizer wrapper; weights read in slices, counted in ``progress``. A
    cross-attention model is served one sequence at a time (:mod:`.serial`)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import get_model_path
    from mlx_vlm.utils import load as load_vlm

    vlm, processor = load_vlm(path, lazy=True)
    directory = Path(get_model_path(path))
    config = json.loads((directory / "config.json").read_text())
    tokenizer = load_tokenizer(directory, eos_token_ids=config.get("eos_token_id"))
    if config.get("model_type") in SERIAL_TYPES:
        read_weights(vlm, progress)
        return CrossAttentionModel(vlm, processor), tokenizer, config
    model = VisionTextModel(vlm, processor)
    model.make_cache()  # raises for caches the batch cannot take, before any weight is read
    read_weights(vlm, progress)
    record_layers(vlm)
    return model, tokenizer, config


def image_tokenizer(model: Any, tokenizer: Any) -> ImageTokenizer | None:
    """The Trio side's view of a loaded VLM's processor (None: not a VLM, or
    one whose template places images in a way not known here)."""
    if isinstance(model, CrossAttentionModel):
        return ImageTokenizer.for_model(model.processor, tokenizer, single=True)
    if not isinstance(model, VisionTextModel):
        return None
    return ImageTokenizer.for_model(model.processor, tokenizer)


@dataclass
class VisionPrefill:
    """A sequence's prompt, from where its cached prefix ends to where its last
    image ends, run into ``cache`` one unit per call of :meth:`advance`."""

    model: VisionTextModel
    prompt: list[int]  # key tokens, as the handle holds it
    vision: VisionPrompt | None  # None: a text prompt (M-RoPE still wants its cache)
    cache: list[Any]
    position: int  # tokens already in the cache
    rope_delta: int = 0
    _positions: Any = None  # M-RoPE: every prompt token's 3-D position
    encoded: int = 0  # images encoded so far
    # The unit in progress: what is left to evaluate, and where it ends.
    _pending: list[list[Any]] = field(default_factory=list)
    _unit_end: int = 0

    @classmethod
    def start(
        cls,
        model: VisionTextModel,
        prompt: list[int],
        vision: VisionPrompt | None,
        cache: Any,
        at: int,
    ) -> VisionPrefill:
        job = cls(model, prompt, vision, cache or model.make_cache(), at)
        if model.mrope and vision is not None:
            job._positions, job.rope_delta = _mrope_positions(model, prompt, vision)
        return job

    @property
    def done(self) -> bool:
        return self.vision is None or self.position >= self.vision.end

    @property
    def settled(self) -> bool:
        """No unit is half done: the cache holds exactly ``position`` tokens.
        (Mid-unit it holds a graph through the unit's end, not evaluated.)"""
        return not self._pending

    def batch_cache(self) -> list[Any]:
        """The cache to insert into the batch (M-RoPE: carrying the delta)."""
        if self.model.mrope:
            return [MRopeKVCache.adopt(c, self.rope_delta) for c in self.cache]
        return self.cache

    def advance(self, text_chunk: int) -> int:
        """Run the next piece of work: one layer's evaluation of the unit in
        progress (see :func:`record_layers`), or a new unit: up to
        ``text_chunk`` tokens of text, or the next image. Returns how many
        prompt tokens entered the cache (0 until a unit's last piece)."""
        if not self._pending:
            self._plan_unit(text_chunk)
        mx.eval(self._pending.pop(0))
        if self._pending:
            return 0
        _forget_rope_state(self.model.language)
        ran, self.position = self._unit_end - self.position, self._unit_end
        return ran

    def _plan_unit(self, text_chunk: int) -> None:
        assert self.vision is not None, "advance() on a text prompt"
        span = next(s for s in self.vision.spans if s.end > self.position)
        if self.position < span.start:
            end = min(span.start, self.position + max(1, text_chunk))
            self._pending = self._build(self.position, end, None)
        else:
            end = span.end
            self._pending = self._build(span.start, end, span)
            self.encoded += 1
        self._unit_end = end

    def _build(self, start: int, end: int, span: ImageSpan | None) -> list[list[Any]]:
        """The unit's graph, built lazily: what to evaluate, in order (each
        recorded layer's output, then the cache)."""
        assert self.vision is not None
        language = self.model.language
        ids = mx.array(self.vision.model_tokens(self.prompt, start, end))[None]
        extra: dict[str, Any] = {}
        embeds = None
        with recording() as layers:
            if span is not None:
                arrays = {k: mx.array(v) for k, v in span.arrays.items() if k != "num_crops"}
                pixels = arrays.pop("pixel_values")
                features = self.model.vlm.get_input_embeddings(
                    ids, pixels, mask=mx.ones(ids.shape, dtype=mx.int32), **arrays
                )
                embeds = features.inputs_embeds
                extra = {
                    k: v
                    for k, v in features.to_dict().items()
                    if v is not None and k not in ("inputs_embeds", "position_ids", "rope_deltas")
                }
            if self._positions is not None:
                # The language model slices whole-prompt positions at its cache offset.
                extra["position_ids"] = self._positions
            language(ids, inputs_embeds=embeds, cache=self.cache, **extra)
        return [*layers, [c.state for c in self.cache]]


# -- evaluating a unit one layer at a time -------------------------------------------------

_recorder = threading.local()


@contextmanager
def recording() -> Iterator[list[list[Any]]]:
    """Collect the outputs of the layers :func:`record_layers` marked, as the
    graph is built (on this thread): evaluating them one after the other
    computes the graph a layer at a time, each piece an engine step's work."""
    outputs: list[list[Any]] = []
    _recorder.outputs = outputs
    try:
        yield outputs
    finally:
        _recorder.outputs = None


def record_layers(vlm: Any) -> int:
    """Mark the vision tower's and the language model's layer stacks (the
    longest list of blocks in each) so that :func:`recording` sees their
    outputs; returns how many layers were marked. A tower that evaluates its
    hidden states while its graph is built still works, in one piece."""
    marked = 0
    for part in (getattr(vlm, "vision_tower", None), getattr(vlm, "language_model", None)):
        if part is None:
            continue
        for layer in _longest_stack(part):
            layer.__class__ = _recorded_class(type(layer))  # the same weights, recorded
            marked += 1
    return marked


def _longest_stack(module: Any) -> list[Any]:
    stacks: dict[str, list[Any]] = {}
    for name, child in module.named_modules():
        parent, _, index = name.rpartition(".")
        if index.isdigit():
            stacks.setdefault(parent, []).append(child)
    return max(stacks.values(), key=len, default=[])


_recorded_classes: dict[type, type] = {}


def _recorded_class(cls: type) -> type:
    """``cls`` with its outputs recorded (one subclass per class)."""
    if getattr(cls, "_mlxtrio_recorded", False):
        return cls
    if cls not in _recorded_classes:
        _recorded_classes[cls] = _make_recorded(cls)
    return _recorded_classes[cls]


def _make_recorded(cls: type) -> type:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = cls.__call__(self, *args, **kwargs)
        outputs = getattr(_recorder, "outputs", None)
        if outputs is not None:
            leaves = cast(list[tuple[str, Any]], tree_flatten(out))
            arrays = [v for _, v in leaves if isinstance(v, mx.array)]
            if arrays:
                outputs.append(arrays)
        return out

    return type(cls.__name__, (cls,), {"__call__": __call__, "_mlxtrio_recorded": True})


def _mrope_positions(
    model: VisionTextModel, prompt: list[int], vision: VisionPrompt
) -> tuple[Any, int]:
    """Every prompt token's M-RoPE position, and the delta the text after the
    last image runs at (its position minus its index)."""
    grids = [s.arrays["image_grid_thw"] for s in vision.spans]
    ids = mx.array(vision.model_tokens(prompt))[None]
    positions, _ = model.language.get_rope_index(ids, image_grid_thw=mx.array(_concat(grids)))
    _forget_rope_state(model.language)
    last = len(prompt) - 1
    delta = int(positions[0, 0, last].item()) - last
    return positions, delta


def _concat(arrays: list[Any]) -> Any:
    import numpy as np

    return np.concatenate(arrays)


def _forget_rope_state(language: Any) -> None:
    """mlx-vlm's Qwen-VL language models remember a generation's rope state
    between calls; every call here passes its positions, so clear it."""
    for name in ("_rope_deltas", "_position_ids"):
        if hasattr(language, name):
            setattr(language, name, None)
