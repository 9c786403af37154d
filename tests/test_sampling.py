"""Logits processors, driven step by step the way ``BatchGenerator`` calls them:
``(token context, logits)`` once per decode step, the context ending with the
token sampled at the previous step (the last prompt token at step 0)."""

from __future__ import annotations

import mlx.core as mx

from mlxtrio.engine.sampling import (
    TokenTexts,
    forced_text_processor,
    reasoning_budget_processor,
)

VOCAB = 24


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


# A toy vocabulary: token i has text TEXTS[i].
TEXTS = ["", "a", "b", "c", "<", "<call>", '{"n', '":', "x", "xy", "", "y", "zz", "z", "!"]
TEXTS += ['{"n":x', "cal", "l>"]
VOCAB_TEXTS = TokenTexts(TEXTS + [""] * (VOCAB - len(TEXTS)))
LT, OPEN, QUOTE, COLON, X, XY, Y, ZZ, Z, BANG, WHOLE, CAL, L_GT = (
    4,
    5,
    6,
    7,
    8,
    9,
    11,
    12,
    13,
    14,
    15,
    16,
    17,
)


def forced(openings: tuple[str, ...], after: int | None = None):
    return forced_text_processor(openings, after, VOCAB_TEXTS)


def test_forced_text_comes_first_then_the_model_continues() -> None:
    assert drive(forced(('<call>{"n":',)), [OPEN, 1, 2, 3]) == [OPEN, QUOTE, COLON, 3]


def test_any_tokenisation_of_the_opening_is_allowed() -> None:
    # the model wants "a": it gets the best token that fits ("<", lowest id on a
    # tie), then spells the rest its own way
    assert drive(forced(("<call>",)), [1, CAL, L_GT, 2]) == [LT, CAL, L_GT, 2]
    # a token covering the opening and more (as the scripted test models' whole
    # calls) is allowed, and ends the constraint
    assert drive(forced(('{"n":',)), [WHOLE, 2, 3]) == [WHOLE, 2, 3]


def test_the_model_picks_among_openings_where_they_diverge() -> None:
    openings = ("x!", "zz!")
    assert drive(forced(openings), [ZZ, 1, 1]) == [ZZ, BANG, 1]
    assert drive(forced(openings), [Z, Z, 1, 1]) == [Z, Z, BANG, 1]
    # "xy" and "y" name no offered tool: an allowed token is taken instead
    assert drive(forced(openings), [XY, 1, 1]) == [X, BANG, 1]
    assert drive(forced(openings), [Y, 1, 1]) == [X, BANG, 1]


def test_forced_text_waits_for_the_end_of_reasoning() -> None:
    # reasoning (1, 2), then the model closes it with 3; the opening follows
    assert drive(forced(("<call>",), after=3), [1, 2, 3, OPEN, 2]) == [1, 2, 3, OPEN, 2]


def test_nothing_is_forced_if_reasoning_never_ends() -> None:
    assert drive(forced(("<call>",), after=3), [1, 2, 1, 2]) == [1, 2, 1, 2]


def test_a_prompt_ending_in_the_trigger_does_not_arm_it() -> None:
    assert drive(forced(("<call>",), after=3), [1, 2], prompt_last=3) == [1, 2]


def test_reasoning_budget_then_forced_call_compose() -> None:
    budget = reasoning_budget_processor(2, think_end_id=3)
    opening = forced(("<call>",), after=3)

    def both(context: mx.array, logits: mx.array) -> mx.array:
        return opening(context, budget(context, logits))

    # the model would reason forever (1, 1, ...): the budget closes it at step 2,
    # then the call opens
    assert drive(both, [1, 1, 1, 1, 1, 1]) == [1, 1, 3, LT, 3, 1]  # "<" "c" "a" ...
    # ... until nothing in this toy vocabulary spells "ll>": then it hands off
    # (real vocabularies have every single character, so an opening completes)
