"""A reasoning budget: close the reasoning block once it has run long enough."""

from __future__ import annotations

import mlx.core as mx

from .steps import Steps, only_tokens


class ReasoningBudget:
    """Force the end-of-reasoning token once ``budget`` tokens were generated
    without it (Anthropic ``thinking.budget_tokens``)."""

    def __init__(self, budget: int, think_end_id: int, seen: list[int] | None = None) -> None:
        self.budget, self.think_end_id = budget, think_end_id
        self._steps = Steps(seen)
        self._closed = False

    def plan_draft(self, tokens: list[int]) -> int:
        """Draft positions before the budget runs out (position *j* is the
        call after this one's *j*-th)."""
        if self._closed:
            return len(tokens) - 1
        return max(0, min(len(tokens) - 1, self.budget - self._steps.calls - 1))

    def draft_logits(self, logits: mx.array) -> mx.array:
        return logits

    def skip(self, count: int) -> None:
        self._steps.skip(count)

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        step = self._steps.calls
        known, pending = self._steps.advance(context)
        if pending > 1:
            known, pending = known + self._steps.read(context, pending), 0
        self._closed = self._closed or self.think_end_id in known
        if self._closed or step < self.budget:
            return logits
        forced = only_tokens([self.think_end_id], logits)
        if not pending:
            self._closed = True
            return forced
        # Unless the pending token closed it already, close it now.
        return mx.where(context[-1] == self.think_end_id, logits, forced)
