"""One sequence as the engine thread sees it: its bookkeeping, and the guard
that keeps a failing logits processor from taking its batch down with it.

Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .handle import GenerationHandle
from .types import GenerationEvent, GenerationStats

log = logging.getLogger("mlxtrio.engine")


class SequenceGuard:
    """One sequence's logits processors, run so that an exception in them ends
    that sequence instead of the batch step: the first error is kept, the logits
    pass through unchanged from then on, and the loop fails the sequence after
    the step."""

    def __init__(self, processors: list[Callable[[Any, Any], Any]]) -> None:
        # Any: those that take part in drafts have plan_draft/draft_logits/skip too.
        self.processors: list[Any] = processors
        self.error: BaseException | None = None

    @property
    def can_draft(self) -> bool:
        """Whether every processor takes part in speculative decoding (the
        penalties do not: they steer every position)."""
        return all(hasattr(p, "plan_draft") for p in self.processors)

    def plan_draft(self, tokens: list[int]) -> int:
        """How many draft positions the processors can verify in one forward
        pass. ``tokens`` are the pending token (sampled under the processors,
        not yet taken in), then the draft; position *j* is the logits after
        ``tokens[j]``. Each processor prepares what it does to those
        positions (:meth:`draft_logits`: a fixed mask, a grammar's masks, or
        nothing); 0 when one failed, or cannot say (it would steer by what
        the draft itself decides, such as a trigger token)."""
        if self.error is not None or not self.can_draft:
            return 0
        try:
            return min((p.plan_draft(tokens) for p in self.processors), default=len(tokens) - 1)
        except Exception:  # a draft is an option: without one the step is plain
            log.debug("a logits processor could not plan a draft", exc_info=True)
            return 0

    def draft_logits(self, logits: Any) -> Any:
        """The draft positions' ``logits`` (one row each, from position 1) as
        the processors planned them."""
        if self.error is not None:
            return logits
        try:
            for processor in self.processors:
                logits = processor.draft_logits(logits)
            return logits
        except Exception as exc:
            self.error = exc
            return logits

    def skip(self, count: int) -> None:
        """``count`` accepted draft tokens were generated without a call."""
        for processor in self.processors:
            processor.skip(count)

    def __call__(self, context: Any, logits: Any) -> Any:
        if self.error is not None:
            return logits
        try:
            out = logits
            for processor in self.processors:
                out = processor(context, out)
            return out
        except Exception as exc:  # a processor bug must not take the batch down
            self.error = exc
            return logits


@dataclass
class LiveSequence:
    """Engine-thread bookkeeping for one live sequence."""

    handle: GenerationHandle
    uid: int
    detokenizer: Any
    submitted_at: float
    stats: GenerationStats
    guard: SequenceGuard | None
    generated: list[int]  # token ids, as received (the processors' host view)
    prefill_started_at: float | None = None
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    # In-flight reuse: a request waits to start from this one's prompt once
    # it holds ``share_at`` tokens; ``shared`` once it was snapshotted for it.
    share_requested: bool = False
    share_at: int = 0
    shared: bool = False
    # Where its prompt is still to be snapshotted, in order (caches that
    # cannot be trimmed: see EngineLoop._boundaries).
    boundaries: list[int] = field(default_factory=list)
    # Prompt tokens put in its cache before it joined the batch (its images'
    # prefill, see .vision): the batch counts only what it prefills itself.
    staged: int = 0

    @property
    def prefilling(self) -> bool:
        return self.prefill_done_at is None

    @property
    def context(self) -> int:
        """Tokens in its KV cache so far (while prefilling)."""
        return self.stats.cached_tokens + self.stats.prefilled_tokens

    def share_when(self, at: int) -> None:
        """Snapshot it for a waiting request once it holds ``at`` tokens."""
        self.share_at = max(self.share_at, at)
        self.share_requested = True

    def prefilled(self, response: Any, now: float) -> bool:
        """Take in a step's prefill progress (mlx-lm's prompt response); True
        when its cache reached the next boundary to snapshot at."""
        if self.prefill_started_at is None:
            self.prefill_started_at = now
            self.stats.queue_seconds = now - self.submitted_at
        self.stats.prefilled_tokens = self.staged + int(response.progress[0])
        self.handle.prefilled = self.context
        boundary = bool(self.boundaries) and response.end_of_segment
        if boundary and self.context >= self.boundaries[0]:
            del self.boundaries[0]
        else:
            boundary = False
        if response.end_of_prompt:
            self.prefill_done_at = now
        return boundary

    def take_token(self, token: int, finish_reason: str | None, now: float) -> GenerationEvent:
        """Count and detokenize a generated token; the event that carries it
        (with the stats, as the last one, when ``finish_reason`` is set)."""
        stats = self.stats
        stats.generated_tokens += 1
        self.generated.append(token)
        if self.first_token_at is None:
            self.first_token_at = now
            self.prefill_done_at = self.prefill_done_at or now
            stats.time_to_first_token = now - self.submitted_at
        detok = self.detokenizer
        if finish_reason != "stop":  # the stop token itself is never shown
            detok.add_token(token)
        if finish_reason is None:
            return GenerationEvent((token,), detok.last_segment)
        detok.finalize()
        return GenerationEvent((token,), detok.last_segment, finish_reason, stats)  # type: ignore[arg-type]


def finish_stats(seq: LiveSequence, now: float) -> None:
    """Fill in the sequence's prefill and decode speeds as it ends."""
    stats = seq.stats
    if seq.prefill_started_at is not None and seq.prefill_done_at is not None:
        elapsed = seq.prefill_done_at - seq.prefill_started_at
        if elapsed > 0 and stats.prefilled_tokens:
            stats.prefill_tokens_per_second = stats.prefilled_tokens / elapsed
    if seq.first_token_at is not None and stats.generated_tokens > 1:
        elapsed = now - seq.first_token_at
        if elapsed > 0:
            stats.decode_tokens_per_second = (stats.generated_tokens - 1) / elapsed
