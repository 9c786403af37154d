"""Logits processors, driven step by step the way ``BatchGenerator`` calls them:
``(token context, logits)`` once per decode step, the context ending with the
token sampled at the previous step (the last prompt token at step 0).

Each test runs twice: with the processor reading every token off the device, and
with the engine's host view one step behind (``seen``), as the server runs them.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxtrio.engine.processors.openings import OpeningConstraint, TokenTexts
from mlxtrio.engine.processors.reasoning import ReasoningBudget

VOCAB = 24


SEEN: list[int] | None = None  # the host view of the processors being driven


@pytest.fixture(autouse=True, params=["device", "host"])
def host_view(request: pytest.FixtureRequest):
    global SEEN
    SEEN = [] if request.param == "host" else None
    yield
    SEEN = None


def drive(process, script: list[int | None], prompt_last: int = 0) -> list[int]:
    """Greedy-decode with ``process``; the model "wants" ``script[i]`` at step i
    (``None``: no preference). Returns the tokens actually produced. The host
    view lags one token, as the engine's does."""
    produced: list[int] = []
    context = [prompt_last]
    for wanted in script:
        if SEEN is not None:
            SEEN[:] = produced[:-1]
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


def forced(openings: tuple[str, ...], after: int | None = None, repeat: bool = False):
    return OpeningConstraint(openings, after, VOCAB_TEXTS, repeat, seen=SEEN)


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


def test_a_repeating_constraint_applies_after_every_marker() -> None:
    # OPEN plays the tool-call marker; each call must name "x" or "zz"
    guard = forced(("x!", "zz!"), OPEN, repeat=True)
    # free text, then a call naming an unoffered "y": redirected to "x!"
    # (the model's next choice, 2, comes after); a second call gets "zz!"
    script = [1, OPEN, Y, 1, 2, OPEN, ZZ, 1, 3]
    assert drive(guard, script) == [1, OPEN, X, BANG, 2, OPEN, ZZ, BANG, 3]


def test_a_single_constraint_is_spent_after_its_first_opening() -> None:
    once = forced(("x!",), OPEN)
    assert drive(once, [OPEN, X, BANG, OPEN, Y, 1]) == [OPEN, X, BANG, OPEN, Y, 1]


def test_reasoning_budget_then_forced_call_compose() -> None:
    budget = ReasoningBudget(2, think_end_id=3, seen=SEEN)
    opening = forced(("<call>",), after=3)

    def both(context: mx.array, logits: mx.array) -> mx.array:
        return opening(context, budget(context, logits))

    # the model would reason forever (1, 1, ...): the budget closes it at step 2,
    # then the call opens
    assert drive(both, [1, 1, 1, 1, 1, 1]) == [1, 1, 3, LT, 3, 1]  # "<" "c" "a" ...
    # ... until nothing in this toy vocabulary spells "ll>": then it hands off
    # (real vocabularies have every single character, so an opening completes)


def test_free_running_steps_do_not_wait_on_the_device(monkeypatch, host_view) -> None:
    """With the host view, only the steps that steer a call read the pending token."""
    from mlxtrio.engine.processors import steps

    reads: list[int] = []
    real = steps.Steps.read

    def counting(self, context, pending):
        reads.append(pending)
        return real(self, context, pending)

    monkeypatch.setattr(steps.Steps, "read", counting)
    guard = forced(("x!",), OPEN, repeat=True)
    assert drive(guard, [1, 2, 1, 2, OPEN, Y, 1, 2]) == [1, 2, 1, 2, OPEN, X, BANG, 2]
    budget = ReasoningBudget(3, think_end_id=3, seen=SEEN)
    assert drive(budget, [1, 1, 3, 1]) == [1, 1, 3, 1]
    if SEEN is not None:
        # only the call's two steered tokens ("x", "!"), one at a time
        assert reads == [1, 1]
