"""One sequence's logits processors, from its sampling parameters: penalties,
a reasoning budget, and one processor per output constraint. Engine thread.
"""

from __future__ import annotations

from typing import Any

from ..types import GrammarConstraint, SamplingParams, TextConstraint
from .grammar_masks import GrammarProcessor
from .openings import OpeningConstraint, TokenTexts
from .reasoning import ReasoningBudget
from .sampling import penalty_processors

SPELLINGS_KEPT = 4096  # tool-call openings recur request after request


class ProcessorFactory:
    """Builds processors for one model: ``tokenizer`` (mlx-lm's wrapper) and
    the text of every token. Keeps how the tokenizer spells constrained
    openings, which recur from request to request."""

    def __init__(self, tokenizer: Any, token_texts: TokenTexts) -> None:
        self.tokenizer = tokenizer
        self.token_texts = token_texts
        self._spellings: dict[str, tuple[int, ...]] = {}

    def for_sequence(self, params: SamplingParams, generated: list[int]) -> list[Any]:
        """The processors of a sequence sampled with ``params``; ``generated``
        is its generated tokens as the host receives them (the processors
        read it instead of waiting on the device)."""
        processors: list[Any] = penalty_processors(params)
        end_tokens = tuple(getattr(self.tokenizer, "think_end_tokens", None) or ())
        if params.reasoning_budget is not None and len(end_tokens) == 1:
            processors.append(ReasoningBudget(params.reasoning_budget, end_tokens[0], generated))
        processors.extend(self.constraint(c, generated) for c in params.constraints)
        return processors

    def constraint(
        self, constraint: TextConstraint | GrammarConstraint, seen: list[int] | None = None
    ) -> Any:
        """The processor that enforces ``constraint`` on one sequence (``seen``:
        its generated tokens as the host receives them; None: read them off
        the device)."""
        if isinstance(constraint, GrammarConstraint):
            return GrammarProcessor(constraint.grammar, constraint.after, constraint.repeat, seen)
        spellings = tuple(self.spelling(text) for text in constraint.openings)
        return OpeningConstraint(
            constraint.openings,
            constraint.after,
            self.token_texts,
            constraint.repeat,
            spellings,
            seen,
        )

    def spelling(self, text: str) -> tuple[int, ...]:
        """How the tokenizer spells ``text``."""
        spelling = self._spellings.get(text)
        if spelling is None:
            if len(self._spellings) >= SPELLINGS_KEPT:
                self._spellings.clear()
            spelling = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            self._spellings[text] = spelling
        return spelling
