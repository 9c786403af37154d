"""Images as a vision-language model's prompt tokens (no MLX here: worker threads).

A VLM's chat template writes one short placeholder per image (Qwen-VL's
``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3's ``<start_of_image>``);
its processor then widens each into the run of tokens the vision tower's
features replace, as many as the image yields at the size the processor
resizes it to. :class:`ImageTokenizer` does that widening one image at a time,
with the model's own image processor (numpy: no MLX, so any thread may call
it), which gives

* the exact token count before anything runs (``count_tokens`` and usage), and
* the pixels each image's encode needs, kept per image so that the engine
  encodes only the images its prefix cache does not already hold.

Prefix-cache keys know the pixels: in the token list the rest of the server
sees (lookups, KV block names, the disk tier), an image's run is written as
*key tokens* derived from the image's content hash and position in the run,
ids no vocabulary has (at or above :data:`KEY_BASE`). The same screenshot
sent again is the same run of keys, so its KV is reused; a different image
at the same place is a different run, so the match stops where it starts.
The engine maps key tokens back to the model's ids
(:meth:`VisionPrompt.model_tokens`) before anything reaches the model.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# Key tokens live in [KEY_BASE, 2 * KEY_BASE): above any vocabulary, within
# int32 (the BatchGenerator's token arrays) and the disk tier's int64 names.
KEY_BASE = 1 << 30

# The size the processor may scale an image to for Responses' detail "low"
# (OpenAI documents 512 x 512 for it): fewer tokens, a coarser look.
LOW_DETAIL_PIXELS = 512 * 512

_CACHE_BYTES = 256 << 20  # encoded images kept for the next turn (pixels mostly)


class ImageTokenError(ValueError):
    """The model's processor could not take an image (a 400: it is the request's)."""


@dataclass(frozen=True)
class ImageSpan:
    """One image's run in a prompt: ``[start, end)``, the model's ids there,
    and what its encode needs (the processor's arrays for this image alone)."""

    start: int
    end: int
    ids: tuple[int, ...]
    arrays: dict[str, np.ndarray]
    digest: str


@dataclass(frozen=True)
class VisionPrompt:
    """A prompt's images, in order. The prompt itself holds key tokens where
    they stand (see the module docstring)."""

    spans: tuple[ImageSpan, ...]

    @property
    def end(self) -> int:
        """Where the last image's run ends: the engine encodes up to here."""
        return self.spans[-1].end

    def model_tokens(self, prompt: list[int], start: int = 0, stop: int | None = None) -> list[int]:
        """``prompt[start:stop]`` with each image's key tokens replaced by the
        model's ids."""
        stop = len(prompt) if stop is None else stop
        tokens = list(prompt[start:stop])
        for span in self.spans:
            lo, hi = max(span.start, start), min(span.end, stop)
            if lo < hi:
                tokens[lo - start : hi - start] = span.ids[lo - span.start : hi - span.start]
        return tokens

    def inside(self, length: int) -> ImageSpan | None:
        """The image whose run ``length`` cuts (a prefix ending inside it)."""
        return next((s for s in self.spans if s.start < length < s.end), None)


@dataclass(frozen=True)
class _Encoded:
    ids: tuple[int, ...]
    keys: tuple[int, ...]
    arrays: dict[str, np.ndarray]
    nbytes: int


class ImageTokenizer:
    """A VLM's processor, for one image at a time (thread-safe).

    ``image_text`` is what the chat template writes for one image; ``pattern``
    its tokens. Two ways of widening it are known: a run of the image token
    as long as the image's patch grid after merging (Qwen-VL: the processor
    reports ``image_grid_thw``) or the processor's fixed full image sequence
    (Gemma 3: ``full_image_sequence`` in place of ``boi_token``). A model that
    reads images by cross-attention (mllama, ``single``) keeps the pattern as
    it is: one token per image."""

    def __init__(
        self, processor: Any, tokenizer: Any, image_text: str, single: bool = False
    ) -> None:
        self.processor = processor
        self.single = single
        self.image_processor = processor.image_processor
        self.tokenizer = tokenizer
        self.image_text = image_text
        self.pattern = list(tokenizer.encode(image_text, add_special_tokens=False))
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str | None], _Encoded] = OrderedDict()
        self._cached_bytes = 0

    @classmethod
    def for_model(
        cls, processor: Any, tokenizer: Any, single: bool = False
    ) -> ImageTokenizer | None:
        """The model's image tokenizer, or None when its template or processor
        is not one of the known kinds (the model is then served as text)."""
        if getattr(processor, "image_processor", None) is None:
            return None
        text = _template_image_text(tokenizer)
        if not text:
            return None
        made = cls(processor, tokenizer, text, single)
        return made if made._widening() is not None else None

    def _widening(self) -> str | None:
        if self.single:
            return "single"
        if getattr(self.processor, "full_image_sequence", None) and getattr(
            self.processor, "boi_token", None
        ):
            return "sequence"
        if getattr(self.processor, "image_token", None) and hasattr(
            self.image_processor, "merge_size"
        ):
            return "grid"
        return None

    def encode(self, image: Callable[[], Any], digest: str, detail: str | None = None) -> _Encoded:
        """One image as the model's ids, key tokens and arrays; ``image``
        opens it (a PIL image), called only when it was not encoded lately."""
        key = (digest, detail)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        encoded = self._encode(image, digest, detail)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = encoded
                self._cached_bytes += encoded.nbytes
                while self._cached_bytes > _CACHE_BYTES and len(self._cache) > 1:
                    _, dropped = self._cache.popitem(last=False)
                    self._cached_bytes -= dropped.nbytes
        return encoded

    def _encode(self, image: Callable[[], Any], digest: str, detail: str | None) -> _Encoded:
        options: dict[str, Any] = {}
        if detail == "low" and self._widening() == "grid":
            default = getattr(self.image_processor, "max_pixels", None) or LOW_DETAIL_PIXELS
            options["max_pixels"] = min(default, LOW_DETAIL_PIXELS)
        try:
            raw = self.image_processor(images=[image().convert("RGB")], **options)
        except Exception as exc:  # the processor's own refusals (sizes, modes)
            raise ImageTokenError(f"the model's image processor could not read it: {exc}") from exc
        arrays = {k: np.asarray(v) for k, v in dict(raw).items() if v is not None}
        ids = self._widen(arrays)
        return _Encoded(
            tuple(ids),
            key_tokens(digest, len(ids)),
            arrays,
            sum(a.nbytes for a in arrays.values()),
        )

    def _widen(self, arrays: dict[str, np.ndarray]) -> list[int]:
        convert = self.tokenizer.convert_tokens_to_ids
        if self._widening() == "single":
            return list(self.pattern)
        if self._widening() == "sequence":
            full = self.tokenizer.encode(
                self.processor.full_image_sequence, add_special_tokens=False
            )
            boi = convert(self.processor.boi_token)
            return [t for p in self.pattern for t in (full if p == boi else [p])]
        count = int(np.prod(arrays["image_grid_thw"][0])) // self.image_processor.merge_size**2
        image_token = convert(self.processor.image_token)
        return [t for p in self.pattern for t in ([p] * count if p == image_token else [p])]

    def splice(
        self, tokens: list[int], images: list[tuple[Callable[[], Any], str, str | None]]
    ) -> tuple[list[int], VisionPrompt | None]:
        """``tokens`` (the template's rendering, one ``pattern`` per image)
        with each image's run in place, as key tokens; and where they stand.
        ``images``: (opens the image, content digest, detail) in order."""
        if not images:
            return tokens, None
        out: list[int] = []
        spans: list[ImageSpan] = []
        width = len(self.pattern)
        i = 0
        while i < len(tokens):
            if len(spans) < len(images) and tokens[i : i + width] == self.pattern:
                image, digest, detail = images[len(spans)]
                encoded = self.encode(image, digest, detail)
                start = len(out)
                out.extend(encoded.keys)
                spans.append(ImageSpan(start, len(out), encoded.ids, encoded.arrays, digest))
                i += width
            else:
                out.append(tokens[i])
                i += 1
        if len(spans) != len(images) or _count(tokens, self.pattern) != len(images):
            # Fewer: the template dropped a message; more: the text itself
            # spells the model's image markup, which would take an image's place.
            raise ImageTokenError(
                f"the prompt holds the model's image markup {_count(tokens, self.pattern)} "
                f"times for {len(images)} images (its text may not spell that markup)"
            )
        return out, VisionPrompt(tuple(spans))


def _count(tokens: list[int], pattern: list[int]) -> int:
    width, first = len(pattern), pattern[0]
    return sum(1 for i, t in enumerate(tokens) if t == first and tokens[i : i + width] == pattern)


def key_tokens(digest: str, count: int) -> tuple[int, ...]:
    """The key tokens of an image's run of ``count`` tokens: each names the
    image (its content hash) and its place in the run."""
    seed = hashlib.blake2b(digest.encode(), digest_size=16).digest()
    words = bytearray()
    for block in range(-(-count // 16)):
        words += hashlib.blake2b(seed + block.to_bytes(4, "little"), digest_size=64).digest()
    values = np.frombuffer(bytes(words), dtype="<u4")[:count] & (KEY_BASE - 1)
    return tuple(int(v) + KEY_BASE for v in values)


def _template_image_text(tokenizer: Any) -> str:
    """What the chat template writes for one image: the difference between a
    user turn with an image part and the same turn without."""
    mark = "\u00b6"

    def rendered(parts: list[dict[str, Any]]) -> str:
        return str(
            tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
        )

    try:
        with_image = rendered([{"type": "image"}, {"type": "text", "text": mark}])
        without = rendered([{"type": "text", "text": mark}])
    except Exception:
        return ""
    head = 0
    while head < min(len(with_image), len(without)) and with_image[head] == without[head]:
        head += 1
    tail = 0
    while (
        tail < min(len(with_image), len(without)) - head
        and with_image[-1 - tail] == without[-1 - tail]
    ):
        tail += 1
    return with_image[head : len(with_image) - tail]
