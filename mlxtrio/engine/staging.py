"""Sequences in their vision prefill, before they join the batch (engine thread).

A sequence whose prompt holds images not yet in the prefix cache is *staged*:
:class:`~.vision.VisionPrefill` puts its images (and the text between them)
into its cache, an engine step's time at a time (:func:`advance_for_a_step`),
and then it joins mlx-lm's ``BatchGenerator`` like a prefix-cache hit with
what :class:`Join` keeps for it. The loop (:mod:`.loop`) owns the staged
sequences and their events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .pacing import SOLO_FACTOR, PrefillPacer
from .sequence import LiveSequence, SequenceGuard
from .vision import VisionPrefill

STAGED = -1  # the uid of a sequence not in the batch yet


@dataclass
class Join:
    """What a sequence joins the batch with."""

    params: Any
    stops: Any
    sampler: Any
    guard: SequenceGuard | None
    reused: int  # prompt tokens its cached prefix held


@dataclass
class Staged:
    """A sequence in its vision prefill."""

    seq: LiveSequence
    join: Join
    prefill: VisionPrefill

    def keepable(self) -> bool:
        """Whether its cache holds more than it started from, and exactly its
        prefill's position (no unit half done): worth keeping when it ends."""
        return self.prefill.settled and self.prefill.position > self.join.reused


def advance_for_a_step(staged: Staged, pacer: PrefillPacer, decoding: bool) -> None:
    """Run ``staged``'s vision prefill for about one engine step's prefill
    budget (:data:`~.pacing.SOLO_FACTOR` budgets when no stream waits):
    layer by layer (an image's tower, then the language model over its
    tokens; text between images in paced slices). Raises what the model
    raises."""
    seq, prefill = staged.seq, staged.prefill
    now = time.perf_counter()
    if seq.prefill_started_at is None:
        seq.prefill_started_at = now
        seq.stats.queue_seconds = now - seq.submitted_at
    budget = pacer.budget * (1 if decoding else SOLO_FACTOR)
    chunk = pacer.chunk(prefill.position, 1, decoding)
    while not prefill.done:
        seq.stats.prefilled_tokens += prefill.advance(chunk)
        if time.perf_counter() - now >= budget:
            break
    seq.handle.prefilled = prefill.position
