"""Logits processors, driven step by step the way ``BatchGenerator`` calls them:
``(token context, logits)`` once per decode step, the context ending with the
token sampled at the previous step (the last prompt token at step 0)."""

from __future__ import annotations

import mlx.core as mx

from mlxtrio.engine.sampling import forced_tokens_processor, reasoning_budget_processor

VOCAB = 16


def drive(process, script: list[int | None], prompt_last: int = 0) -> list[int]:
    """Greedy-decode with ``process``; the model "wants" ``script[i]`` at step i
    (``None``: no preference). Returns the tokens actually produced."""
    produced: list[int] = []
    context = [prompt_last]
    for wanted in script:
        logits = mx.zeros((VOCAB,))
        if wanted is not None:
            logits = mx.where(mx.arange(VOCAB) == wanted, 5.0, 0.0)
        token = int(mx.argmax(process(mx.array(context), logits)).item())
        produced.append(token)
        context.append(token)
    return produced


def test_forced_tokens_come_first_then_the_model_continues() -> None:
    process = forced_tokens_processor((7, 8, 9), after=None)
    assert drive(process, [1, 2, 3, 4, 5]) == [7, 8, 9, 4, 5]


def test_forced_tokens_wait_for_the_end_of_reasoning() -> None:
    process = forced_tokens_processor((7, 8), after=3)
    # reasoning (1, 2), then the model closes it with 3; the call opens right after
    assert drive(process, [1, 2, 3, 4, 5, 6]) == [1, 2, 3, 7, 8, 6]


def test_nothing_is_forced_if_reasoning_never_ends() -> None:
    process = forced_tokens_processor((7, 8), after=3)
    assert drive(process, [1, 2, 4, 5]) == [1, 2, 4, 5]


def test_a_prompt_ending_in_the_trigger_does_not_arm_it() -> None:
    process = forced_tokens_processor((7,), after=3)
    assert drive(process, [1, 2], prompt_last=3) == [1, 2]


def test_reasoning_budget_then_forced_call_compose() -> None:
    budget = reasoning_budget_processor(2, think_end_id=3)
    forced = forced_tokens_processor((7, 8), after=3)

    def both(context: mx.array, logits: mx.array) -> mx.array:
        return forced(context, budget(context, logits))

    # the model would reason forever (1, 1, ...): the budget closes it at step 2,
    # then the call opens
    assert drive(both, [1, 1, 1, 1, 1, 1]) == [1, 1, 3, 7, 8, 1]
