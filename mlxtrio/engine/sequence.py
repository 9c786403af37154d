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
from .types import GenerationStats

log = logging.getLogger("mlxtrio.engine")


class SequenceGuard:
    """One sequence's logits processors, run so that an exception in them ends
    that sequence instead of the batch step: the first error is kept, the logits
    pass through unchanged from then on, and the loop fails the sequence after
    the step."""

    def __init__(self, processors: list[Callable[[Any, Any], Any]]) -> None:
        self.processors = processors
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
