"""The grammar engine's token masks as a logits processor (engine thread),
and llguidance's view of a model's tokenizer.

A :class:`GrammarProcessor` holds one llguidance matcher per sequence, copied
from a compiled grammar (compiled on the Trio side by
:mod:`mlxtrio.grammar.compiler`; on the other ranks of a distributed model by
:func:`compile_grammar`). It constrains the
output from the first token, or from the token right after a trigger (a
tool-call marker; again after each one when ``repeat``), until the grammar is
complete: its last token is a call's closing marker, or EOS for structured
output (so nothing but the grammar's text can come before the end).

While the grammar steers the output the processor must know each token before
computing the next mask, so those steps wait for the previous token (as the
opening constraints do, see :mod:`.steps`); free steps never wait.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

from .steps import Steps, quiet_until_trigger

log = logging.getLogger("mlxtrio.engine")


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any | None:
    """llguidance's view of an mlx-lm tokenizer (about a second for a large
    vocabulary; built when the model loads), or None when the tokenizer is
    not one it can read (only Hugging Face fast tokenizers are)."""
    try:
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ()) or None
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    except Exception as exc:  # any tokenizer llguidance cannot read
        log.warning("constrained decoding is off for this model: %s", exc)
        return None


def compile_grammar(tokenizer: Any, source: str) -> Any:
    """``source`` (llguidance Lark) compiled for ``tokenizer`` (an llguidance
    tokenizer) on the calling thread: how the other ranks of a distributed
    model compile what rank 0 sends (milliseconds). Raises ValueError."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(source), log_level=0)
    if matcher.is_error():
        raise ValueError(f"grammar failed to compile: {matcher.get_error()}")
    return matcher


class GrammarProcessor:
    """Constrain the output by the compiled grammar ``grammar`` (an llguidance
    ``LLMatcher`` in its initial state, never modified here).

    ``after`` is the trigger token (None: from the first token); ``repeat``
    re-arms the trigger once the grammar is complete. Should the grammar
    engine fail (a resource limit), the output goes free from there on: a
    mask that allows nothing would end the turn mid-call."""

    def __init__(
        self,
        grammar: Any,
        after: int | None,
        repeat: bool = False,
        seen: list[int] | None = None,
    ) -> None:
        self.grammar, self.after, self.repeat = grammar, after, repeat
        self._steps = Steps(seen)
        self._matcher: Any = grammar.deep_copy() if after is None else None
        self._done = False
        self._first_mask: mx.array | None = None  # allowed right after the trigger
        self._draft_masks: list[np.ndarray] = []  # packed, for the draft's positions

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        known, pending = self._steps.advance(context)
        for token in known:
            self._take(token)
        if self._done:
            return logits
        if pending > 1 or (pending and self._matcher is not None):
            # (Starting the forward pass first with mx.async_eval, so that the
            # mask is computed while it runs, measured slower: the logits are
            # then evaluated apart from the sampling that follows.)
            for token in self._steps.read(context, pending):
                self._take(token)
            pending = 0
        if self._matcher is None:
            if not pending or self.after is None:
                return logits
            # The pending token may be the trigger: decide on the device.
            if self._first_mask is None:
                self._first_mask = _allowed_mask(self.grammar.deep_copy(), logits)
            if self._first_mask is None:
                return logits
            triggered = context[-1] == self.after
            return mx.where(triggered & ~self._first_mask, -mx.inf, logits)
        mask = _allowed_mask(self._matcher, logits)
        if mask is None:
            self._give_up()
            return logits
        return mx.where(mask, logits, -mx.inf)

    # -- speculative decoding (see mlxtrio.engine.sequence.SequenceGuard) --

    def plan_draft(self, tokens: list[int]) -> int:
        """Draft positions this grammar can verify: before its trigger while
        it waits for one; while it steers, as far as the draft keeps to it,
        with the mask of each position worked out ahead (the matcher takes in
        the tokens it has not yet, the pending one and the draft, then gives
        them back)."""
        self._draft_masks = []
        if self._done:
            return len(tokens) - 1
        if self._matcher is None:
            if self.after is None:
                return 0
            return quiet_until_trigger(self._steps.untaken(), tokens, self.after)
        untaken = self._steps.untaken()
        if untaken is None:
            return 0
        matcher, taken = self._matcher, 0
        try:
            for token in [*untaken, tokens[0]]:
                if not _takes(matcher, token):
                    return 0
                taken += 1
            for token in tokens[1:]:
                if not _takes(matcher, token):
                    break
                taken += 1
                if matcher.is_stopped():  # the call ends here: its next position is free
                    break
                packed = np.frombuffer(matcher.compute_bitmask(), np.uint8)
                if matcher.is_error() or not packed.any():
                    break  # where a plain step would give the grammar up
                self._draft_masks.append(packed)
        finally:
            matcher.rollback(taken)
        return len(self._draft_masks)

    def draft_logits(self, logits: mx.array) -> mx.array:
        """The draft's positions' logits under the masks :meth:`plan_draft`
        worked out."""
        if not self._draft_masks:
            return logits
        size = logits.shape[-1]
        rows = [_unpacked(packed, size) for packed in self._draft_masks[: logits.shape[0]]]
        return mx.where(mx.array(np.stack(rows)), logits, -mx.inf)

    def skip(self, count: int) -> None:
        self._steps.skip(count)

    def _take(self, token: int) -> None:
        """Advance by one generated token."""
        if self._done:
            return
        if self._matcher is None:
            if token == self.after:
                self._matcher = self.grammar.deep_copy()
            return
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            # Only a token the mask did not allow gets here (a sampler that
            # ignores -inf would); the grammar cannot follow the output any more.
            self._give_up()
        elif self._matcher.is_stopped():
            self._matcher = None
            self._done = not self.repeat

    def _give_up(self) -> None:
        error = self._matcher.get_error() if self._matcher is not None else ""
        log.warning("constrained output left its grammar; it goes on free: %s", error)
        self._matcher, self._done = None, True


def _takes(matcher: Any, token: int) -> bool:
    """Let ``matcher`` take ``token`` if its grammar allows it (a refused
    token never reaches it: that would leave it in error)."""
    return bool(matcher.validate_tokens([token])) and bool(matcher.consume_token(token))


def _unpacked(packed: np.ndarray, size: int) -> np.ndarray:
    """A packed llguidance bitmask as ``size`` booleans."""
    allowed = np.unpackbits(packed, bitorder="little").astype(bool)
    if allowed.size < size:
        allowed = np.concatenate([allowed, np.zeros(size - allowed.size, dtype=bool)])
    return allowed[:size]


def _allowed_mask(matcher: Any, logits: mx.array) -> mx.array | None:
    """True where ``matcher`` allows the token (never past the grammar
    tokenizer's vocabulary), shaped for ``logits``' last axis. None when the
    matcher failed, or allows nothing: such a mask would force EOS, or sample
    garbage from NaNs."""
    packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    if matcher.is_error():
        return None
    allowed = np.unpackbits(packed, bitorder="little").astype(bool)
    size = logits.shape[-1]
    if allowed.size < size:
        allowed = np.concatenate([allowed, np.zeros(size - allowed.size, dtype=bool)])
    allowed = allowed[:size]
    if not allowed.any():
        return None
    return mx.array(allowed)
