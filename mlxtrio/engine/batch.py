"""mlx-lm's ``BatchGenerator`` as the loop builds and rebuilds it (engine thread)."""

from __future__ import annotations

from typing import Any

from .image_tokens import VisionPrompt
from .model import LoadedModel
from .serial import CrossAttentionModel, SerialGenerator
from .speculation.verify import Speculation, speculative_batch
from .staging import Join


def new_generator(
    loaded: LoadedModel,
    capacity: int,
    default_max_tokens: int,
    max_prefill_chunk: int,
    speculation: Speculation | None = None,
) -> Any:
    """A ``BatchGenerator`` for ``loaded``; its decode steps verify drafts
    when ``speculation`` is given (see .speculation). A cross-attention VLM's
    stand-in runs one sequence at a time (see .serial)."""
    from mlx_lm.generate import BatchGenerator

    if isinstance(loaded.model, CrossAttentionModel):
        return SerialGenerator(loaded.model, default_max_tokens, max_prefill_chunk)

    gen = BatchGenerator(
        loaded.model,
        max_tokens=default_max_tokens,
        stop_tokens=[[t] for t in loaded.tokenizer.eos_token_ids],
        completion_batch_size=capacity,
        prefill_batch_size=capacity,
        # The model-call width inside a step: the cap. The loop sets how many
        # tokens each step takes (mlx-lm copies this value into its prompt
        # batch once, at construction, so it must not be the paced size).
        prefill_step_size=max_prefill_chunk,
    )
    if speculation is not None:
        # Sequences move from prompt processing into this one batch (mlx-lm
        # extends it, never replaces it), so swapping the empty batch at
        # construction puts every decode step through the speculative one.
        gen._generation_batch = speculative_batch(loaded.model, gen.sampler, speculation)
    return gen


def insert(
    gen: Any,
    segments: list[list[int]],
    join: Join,
    cache: Any,
    prefix: list[int],
    vision: VisionPrompt | None = None,
) -> int:
    """Queue one sequence in ``gen``; its uid. ``prefix`` is in ``cache``
    already; ``segments`` follow it (a snapshot may be taken at each end).
    ``vision`` (the prompt's images) matters only to the serial path, which
    encodes them itself."""
    if isinstance(gen, SerialGenerator):
        if cache is not None or prefix:  # Engine.lookup finds no match for it
            raise ValueError("the serial path reuses no cached prefix")
        prompt = [token for segment in segments for token in segment]
        guard = [join.guard] if join.guard else []
        return gen.add(prompt, vision, join.params.max_tokens, join.sampler, guard, join.stops)
    (uid,) = gen.insert_segments(
        [segments],
        max_tokens=[join.params.max_tokens],
        caches=[cache],
        all_tokens=[prefix],
        samplers=[join.sampler],
        logits_processors=[[join.guard] if join.guard else []],
        stop_sequences=[join.stops],
    )
    return int(uid)


def drop_queued(gen: Any, uid: int | None) -> set[int]:
    """Take ``uid`` out of ``gen``'s queue of sequences not yet prefilled;
    the uids still queued."""
    gen._unprocessed_sequences = type(gen._unprocessed_sequences)(
        item for item in gen._unprocessed_sequences if item[0] != uid
    )
    return {item[0] for item in gen._unprocessed_sequences}


def hand_over_queue(old: Any, new: Any) -> None:
    """Move ``old``'s queued sequences to ``new`` and close ``old``. mlx-lm has
    no public way to move queued work between generators; the queue holds
    plain tuples keyed by uid, so it goes over with the uid counter that keeps
    the uids unique."""
    new._unprocessed_sequences = old._unprocessed_sequences
    new._uid_count = old._uid_count
    old.close()
