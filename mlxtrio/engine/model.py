"""Loading a model for the engine: weights, tokenizer, compute type, and the
per-vocabulary tables the request path needs.

Runs on the engine thread (loading touches MLX). The result outlives the thread
that loaded it: an engine thread that is restarted after a crash serves the
same :class:`LoadedModel` without reading the weights again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from .harmony import harmony_tokenizer, is_harmony, marker_ids
from .image_tokens import ImageTokenizer
from .precision import apply_compute_dtype
from .processors.grammar_masks import grammar_tokenizer
from .processors.openings import TokenTexts
from .sizing import kv_bytes_per_token
from .types import LoadProgress
from .weights import read_weights

log = logging.getLogger("mlxtrio.engine")


@dataclass(eq=False)  # one per load: compared (and hashed) by identity
class LoadedModel:
    model: Any  # the mlx-lm model (MLX: engine thread only)
    tokenizer: Any  # mlx-lm TokenizerWrapper; thread-safe to render with
    config: dict[str, Any]
    dtype: str  # what it computes in
    load_seconds: float
    vocab_size: int  # rows of the output layer (may exceed the tokenizer's)
    # The longest text any one token stands for: a prompt of N characters has
    # at least N / max_token_chars tokens, which bounds a prompt's size before
    # paying for its tokenization.
    max_token_chars: int
    # Every token's text, for constrained openings.
    token_texts: TokenTexts
    # The id of the model's tool-call marker when it is one token.
    tool_call_token: int | None
    # The token masked when no tool is offered (see maskable_marker_token).
    tool_call_mask_token: int | None = None
    # The id of the marker that closes a tool call when it is one token.
    tool_call_end_token: int | None = None
    # llguidance's view of the tokenizer (None: no constrained decoding).
    grammar_tokenizer: Any = None
    # Names these weights computing in ``dtype``: KV blocks cached on disk are
    # only ever reused by the same fingerprint.
    fingerprint: str = ""
    # Whether every layer's cache is a plain KVCache (cut into shared blocks,
    # trimmed to any prefix); if not, snapshots are taken at exact boundaries.
    plain_kv: bool = True
    # What the chat template may append to a conversation to prompt the
    # model's turn (with thinking on, and off), longest first: the next turn's
    # prompt goes on where a prompt minus it ends.
    generation_suffixes: tuple[tuple[int, ...], ...] = ()
    # Bytes the weights take as loaded (in ``dtype``), and bytes of KV cache
    # one token takes across the layers (0: the config does not say).
    weights_bytes: int = 0
    kv_bytes_per_token: int = 0
    # A Harmony model (gpt-oss): its markers' token ids (see .harmony).
    harmony: dict[str, int] | None = None
    # The tokenizer's added tokens (markers, markup pieces) by text.
    added_tokens: dict[str, int] = field(default_factory=dict)
    # A vision-language model served with its images: its processor, one
    # image at a time (None: the model reads text; images are placeholders).
    images: ImageTokenizer | None = None

    @property
    def serial(self) -> bool:
        """Generated one sequence at a time, without prefix reuse (see .serial)."""
        return bool(getattr(self.model, "serial", False))

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 32768)


Checkpoint = tuple[Any, Any, dict[str, Any]]  # mlx-lm's model, tokenizer and config


def read_checkpoint(path: str, progress: LoadProgress | None = None) -> Checkpoint:
    """The whole model at ``path`` (a local directory or hub id), through
    mlx-lm (a vision-language model through mlx-vlm, when installed: see
    :mod:`.vision`); its weights read in slices, counted in ``progress``."""
    from mlx_lm import load

    from .serial import SERIAL_TYPES
    from .vision import is_vision_checkpoint, local_config, read_vision_checkpoint, vision_support

    config = local_config(path)
    if is_vision_checkpoint(config) and vision_support(config) is None:
        try:
            return read_vision_checkpoint(path, progress)
        except Exception as exc:  # an architecture mlx-vlm does not know, a bad processor
            if config.get("model_type") in SERIAL_TYPES:
                raise  # mlx-lm has no such language model: mlx-vlm's reason is the one
            log.warning(
                "mlx-vlm could not load %s (%s): loading its language model alone", path, exc
            )

    try:
        model, tokenizer, config = cast(Checkpoint, load(path, lazy=True, return_config=True))
    except Exception as exc:
        why = is_vision_checkpoint(config) and vision_support(config)
        if why:  # say why its images are not served before what mlx-lm could not do
            raise ValueError(f"{why}; mlx-lm cannot load its language model alone: {exc}") from exc
        raise
    read_weights(model, progress)
    return model, tokenizer, config


def load_model(
    name: str,
    path: str,
    compute_dtype: str,
    read: Callable[[str], Checkpoint] | None = None,
    progress: LoadProgress | None = None,
) -> LoadedModel:
    """Load ``path`` with ``read`` and pick its compute type (a distributed
    world reads each rank's shard instead: see
    :func:`.distributed.ranks.read_shard`)."""
    log.info("loading model %s from %s", name, path)
    started = time.perf_counter()
    model, tokenizer, config = read(path) if read is not None else read_checkpoint(path, progress)
    from . import cpu_activation, cpu_attention

    # On the CPU, in the model's modules (imported now).
    cpu_attention.install()
    cpu_activation.install()
    harmony = marker_ids(tokenizer) if is_harmony(config, tokenizer) else None
    if harmony is not None:
        tokenizer = harmony_tokenizer(tokenizer)
        log.info("model %s writes the Harmony format (gpt-oss)", name)
    # Built now rather than at the first request that needs it, which would
    # stall every running sequence while a large vocabulary is decoded.
    texts = TokenTexts.from_tokenizer(tokenizer)
    tool_call_token = tool_call_end_token = None
    if getattr(tokenizer, "has_tool_calling", False):
        tool_call_token = _single_token(tokenizer, tokenizer.tool_call_start)
        tool_call_end_token = _single_token(tokenizer, tokenizer.tool_call_end)
    vocab_size = int(config.get("vocab_size") or len(texts.texts))
    precision = apply_compute_dtype(model, compute_dtype)
    if precision.upcast_reason:
        log.info(
            "model %s computes in %s on the CPU (%s)",
            name,
            precision.dtype,
            precision.upcast_reason,
        )
    if precision.hint:
        log.warning("%s", precision.hint)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        dtype=precision.dtype,
        load_seconds=time.perf_counter() - started,
        vocab_size=vocab_size,
        max_token_chars=max(1, max(map(len, texts.texts), default=1), _longest_added(tokenizer)),
        token_texts=texts,
        tool_call_token=tool_call_token,
        tool_call_mask_token=maskable_marker_token(tokenizer),
        tool_call_end_token=tool_call_end_token,
        grammar_tokenizer=grammar_tokenizer(tokenizer, max(vocab_size, len(texts.texts))),
        fingerprint=weights_fingerprint(path, config, precision.dtype),
        plain_kv=_plain_kv(model),
        generation_suffixes=_generation_suffixes(tokenizer),
        weights_bytes=_weights_bytes(model),
        harmony=harmony,
        added_tokens=dict(getattr(tokenizer, "get_added_vocab", dict)()),
        kv_bytes_per_token=kv_bytes_per_token(config, precision.dtype) or 0,
    )
    log.info(
        "model %s ready in %.2f s (%s, %d layers, context %d, %s)",
        name,
        loaded.load_seconds,
        config.get("model_type", "?"),
        # Multimodal checkpoints nest the language model's fields.
        config.get("num_hidden_layers")
        or config.get("text_config", {}).get("num_hidden_layers", 0),
        loaded.context_length,
        loaded.dtype,
    )
    _say_how_images_are_served(name, loaded)
    return loaded


def _say_how_images_are_served(name: str, loaded: LoadedModel) -> None:
    from .vision import VisionTextModel, image_tokenizer, is_vision_checkpoint, vision_support

    if not is_vision_checkpoint(loaded.config):
        return
    loaded.images = image_tokenizer(loaded.model, loaded.tokenizer)
    kind = loaded.config.get("model_type", "?")
    if loaded.images is not None:
        how = "one sequence at a time: it reads images by cross-attention" if loaded.serial else ""
        log.info("model %s sees images (%s, through mlx-vlm%s)", name, kind, how and f"; {how}")
        return
    # mlx-lm loads a VLM checkpoint's language model and drops its vision
    # tower: say so, or a user would wonder why the model never sees.
    why = vision_support(loaded.config) or (
        "its chat template or processor places images in a way mlxtrio does not know"
        if isinstance(loaded.model, VisionTextModel)
        else "mlx-vlm did not load it (see above; a distributed world reads text only)"
    )
    log.warning(
        "model %s is a vision-language model (%s) served as text only: %s; its images "
        "reach it as placeholders",
        name,
        kind,
        why,
    )


def weights_fingerprint(path: str, config: dict[str, Any], dtype: str) -> str:
    """A name for these weights computing in ``dtype``: the configuration, and
    each weight file's name, size and modification time; in the Hugging Face
    cache a file resolves to a blob named by its content hash. (Hashing the
    weights themselves would cost a full read at every start; a copied model
    directory is a new model to the disk tier, which is the safe side.)"""
    import hashlib
    import json
    from pathlib import Path

    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(dtype.encode())
    directory = Path(path)
    if not directory.is_dir():
        try:
            from mlx_lm.utils import hf_repo_to_path

            directory = hf_repo_to_path(path)
        except Exception:
            digest.update(path.encode())
    for weights in sorted(directory.glob("*.safetensors")) if directory.is_dir() else ():
        stat = weights.stat()
        blob = weights.resolve().name
        digest.update(f"{weights.name}:{blob}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _weights_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    weights = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(int(value.nbytes) for _, value in weights)


def _plain_kv(model: Any) -> bool:
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return all(type(c) is KVCache for c in make_prompt_cache(model))


def _generation_suffixes(tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The tokens the chat template adds for the generation prompt, with
    thinking on and off, longest first (none when it cannot say)."""
    conversation = [{"role": "user", "content": "\u00b6"}]
    found = set()
    for thinking in (True, False):
        try:
            bare, full = (
                _token_ids(
                    tokenizer.apply_chat_template(
                        conversation, add_generation_prompt=generation, enable_thinking=thinking
                    )
                )
                for generation in (False, True)
            )
        except Exception:  # a template that needs more than one user message
            continue
        if full[: len(bare)] == bare and len(full) > len(bare):
            found.add(tuple(full[len(bare) :]))
    return tuple(sorted(found, key=len, reverse=True))


def _token_ids(rendered: Any) -> list[int]:
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]  # some tokenizers return a BatchEncoding
    return list(rendered)


def _single_token(tokenizer: Any, text: str | None) -> int | None:
    """The id of ``text`` when the tokenizer spells it as one token."""
    if not text:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def maskable_marker_token(tokenizer: Any) -> int | None:
    """The token that opens every tool call, when masking it forbids tool calls
    and nothing else: the first token of the tool-call start marker, if it is a
    token of its own (an added token, as ``<tool_call>`` or ``[TOOL_CALLS]``,
    not ordinary text such as ``[``) and, when the marker is several tokens, no
    other marker of the model starts with it (Kimi K3's ``<|open|>`` opens every
    block). None otherwise."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    marker = list(getattr(tokenizer, "tool_call_start_tokens", None) or ())
    if not marker:
        return None
    added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
    text = next((t for t, token in added.items() if token == marker[0]), None)
    if text is None:
        return None
    if len(marker) > 1 and any(other.startswith(text) for other in _other_markers(tokenizer)):
        return None
    return marker[0]


def _other_markers(tokenizer: Any) -> list[str]:
    """Every marker text the model's output may hold besides the tool-call start."""
    found = [
        getattr(tokenizer, name, None) for name in ("think_start", "think_end", "tool_call_end")
    ]
    found += list(getattr(tokenizer, "structural_markers", None) or ())
    transitions = getattr(tokenizer, "response_transitions", None) or {}
    found += [text for edges in transitions.values() for text, _ in edges]
    start = tokenizer.tool_call_start
    return [m for m in found if m and m != start]


def _longest_added(tokenizer: Any) -> int:
    """The longest added (special) token's text: decoding after an anchor, as
    :class:`TokenTexts` does, may render those as empty."""
    added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
    return max((len(text) for text in added), default=1)
