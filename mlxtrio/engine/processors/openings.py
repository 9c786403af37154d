"""Logits processors that make the output go on with a given text: a tool
call's opening (the family's markup up to the tool's name), or nothing at all
after a token that must never be generated (see :mod:`.steps` for how they read
the tokens generated so far).
"""

from __future__ import annotations

import bisect
from typing import Any

import mlx.core as mx

from .steps import Steps, only_tokens, quiet_until_trigger


class TokenTexts:
    """The text of every vocabulary token, indexed for the two questions a text
    constraint asks: which tokens are a prefix of this text, and which tokens'
    text starts with it. Built once per model, on the engine thread."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self._exact: dict[str, list[int]] = {}
        for token, text in enumerate(texts):
            if text:
                self._exact.setdefault(text, []).append(token)
        self._sorted = sorted((text, token) for token, text in enumerate(texts) if text)
        self._keys = [text for text, _ in self._sorted]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenTexts:
        """Decode each token after an anchor token and strip the anchor's text, so
        that tokenizers which drop a leading space when decoding a lone token
        (SentencePiece) still report it."""
        anchor = tokenizer.encode("a", add_special_tokens=False)[:1]
        base = tokenizer.decode(anchor)
        size = max(tokenizer.get_vocab().values()) + 1
        decoded = tokenizer.batch_decode([anchor + [token] for token in range(size)])
        return cls([t[len(base) :] if t.startswith(base) else "" for t in decoded])

    def text(self, token: int) -> str:
        return self.texts[token] if 0 <= token < len(self.texts) else ""

    def consistent_with(self, text: str) -> set[int]:
        """Tokens that can come next if the output must go on with ``text``: a
        non-empty prefix of it, or all of it and more."""
        found = {t for i in range(1, len(text)) for t in self._exact.get(text[:i], ())}
        return found | self.covering(text)

    def covering(self, text: str) -> set[int]:
        """Tokens whose text is ``text`` or starts with it."""
        found = set()
        at = bisect.bisect_left(self._keys, text)
        while at < len(self._keys) and self._keys[at].startswith(text):
            found.add(self._sorted[at][1])
            at += 1
        return found


class OpeningConstraint:
    """Make the output go on with one of ``openings``: from the first step, or
    right after token ``after`` is generated (if it never is, nothing is forced):
    the first time, or every time when ``repeat``. Where openings diverge (tool
    names) the model picks among them by its own logits. Once the output covers
    a whole opening, or no token fits, it continues freely (until ``after`` comes
    again, if ``repeat``).

    ``spellings`` are the openings' own tokenisations (the tokenizer's). When
    given, the output follows them, or takes a token that covers the rest of an
    opening at once: a model scores its usual spelling of a name sensibly, but an
    odd one (``t``, ``ermin``, ...) throws it off what it learnt and it then
    writes broken arguments. Without them, or should the output leave them, any
    tokenisation of the text is allowed.

    With no ``openings`` nothing may follow ``after``: that token is masked at
    every step (see :func:`mlxtrio.grammar.planning.forbid`).
    """

    def __init__(
        self,
        openings: tuple[str, ...],
        after: int | None,
        vocab: TokenTexts,
        repeat: bool = False,
        spellings: tuple[tuple[int, ...], ...] = (),
        seen: list[int] | None = None,
    ) -> None:
        self.openings, self.after, self.vocab = openings, after, vocab
        self.repeat, self.spellings = repeat, spellings
        self._steps = Steps(seen)
        self._open = after is None  # steering the output now
        self._done = False
        self._text = ""  # generated since the opening began
        self._tokens: list[int] = []
        # 0 for the allowed first tokens, -inf elsewhere; built on first use
        self._first_mask: mx.array | None = None
        self._banned = after if not openings and after is not None else None
        self._ban_mask: mx.array | None = None  # 0, and -inf at the banned token

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if self._banned is not None:
            return self._without_banned(logits)
        known, pending = self._steps.advance(context)
        for token in known:
            self._take(token)
        if self._done:
            return logits
        if pending > 1 or (pending and self._open):  # the next choice depends on them
            for token in self._steps.read(context, pending):
                self._take(token)
            pending = 0
        if not self._open:
            if not pending:
                return logits
            # The pending token may be the trigger: decide on the device, with a
            # mask made once (this runs on every free step).
            mask = self._first_tokens_mask(logits)
            return mx.where(context[-1] == self.after, logits + mask, logits)
        allowed = self._allowed(self._text, self._tokens)
        if not allowed:  # cannot happen after _take; kept for safety
            return logits
        return only_tokens(sorted(allowed), logits)

    # -- speculative decoding (see mlxtrio.engine.sequence.SequenceGuard) --

    def plan_draft(self, tokens: list[int]) -> int:
        """Draft positions this constraint leaves alone but for its fixed
        mask (never while it steers, nor past its trigger)."""
        if self._banned is not None or self._done:
            return len(tokens) - 1
        if self._open:
            return 0
        return quiet_until_trigger(self._steps.untaken(), tokens, self.after)

    def draft_logits(self, logits: mx.array) -> mx.array:
        """What it does to the logits of the draft's positions."""
        return self._without_banned(logits) if self._banned is not None else logits

    def skip(self, count: int) -> None:
        if self._banned is None:
            self._steps.skip(count)

    def _take(self, token: int) -> None:
        """Advance the state by one generated token."""
        if self._done:
            return
        if not self._open:
            self._open = token == self.after
            return
        self._text += self.vocab.text(token)
        self._tokens.append(token)
        complete = not self._allowed(self._text, self._tokens)  # or nothing fits
        if complete:  # hand off
            self._open, self._text, self._tokens = False, "", []
            self._done = not self.repeat

    def _allowed(self, text: str, tokens: list[int]) -> set[int]:
        """The tokens that may follow ``text`` (spelled ``tokens``) in an opening."""
        rests = [o[len(text) :] for o in self.openings if o.startswith(text) and len(o) > len(text)]
        if not rests:
            return set()
        at = len(tokens)
        spelled = {s[at] for s in self.spellings if len(s) > at and list(s[:at]) == tokens}
        if spelled:
            return spelled.union(*(self.vocab.covering(rest) for rest in rests))
        return set().union(*(self.vocab.consistent_with(rest) for rest in rests))

    def _without_banned(self, logits: mx.array) -> mx.array:
        """``logits`` with the banned token at -inf. Stateless: no token needs
        to be read, so this never waits on the device."""
        if self._ban_mask is None:
            self._ban_mask = mx.zeros(logits.shape[-1:], dtype=logits.dtype)
            if self._banned is not None and 0 <= self._banned < logits.shape[-1]:
                self._ban_mask[self._banned] = -float("inf")
        return logits + self._ban_mask

    def _first_tokens_mask(self, logits: mx.array) -> mx.array:
        if self._first_mask is None:
            self._first_mask = only_tokens(sorted(self._allowed("", [])), mx.zeros_like(logits))
        return self._first_mask
