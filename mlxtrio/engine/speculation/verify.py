"""mlx-lm's ``GenerationBatch`` with a speculative step (engine thread only).

A plain step feeds each row the token sampled at the step before and samples
the next one; mlx-lm builds step *n*'s graph while step *n-1* runs, so the
host never waits for the device. A speculative step first reads the pending
tokens (it needs them to draft), then feeds each row its pending token followed
by its draft (rows without one are padded and roll the padding back), scores
every position in one forward pass, and keeps, per row, the longest prefix of
the draft its own sampler agrees with, plus the sampler's token at the first
disagreement (or after the whole draft). Sampling each position with the row's
sampler and accepting while it matches the draft is the standard rejection rule
for a draft that is one token with certainty: the output distribution is the
model's, and greedy output is the same token for token.

Which rows draft: those without a seed (a seeded sampler's random stream must
advance exactly as without drafts, so that a seed reproduces its output), and
whose logits processors take part (:class:`~mlxtrio.engine.sequence.SequenceGuard`):
the processors run as always at the first position; for the others they plan
ahead (a grammar works out each drafted position's mask, and the draft ends
where it leaves the grammar; a forbidden token stays masked; a draft stops
before a trigger token, a tool call's opening or a reasoning budget's end;
penalties steer everywhere, so their rows never draft), and accepted draft
tokens are counted in as if each had had its own step. The others ride along
in the wide step with their single token.

Whether a step drafts at all is the :class:`~.policy.Switch`'s call; before
reading the pending tokens the batch asks each row's index whether its last
known tokens occurred before, so a batch with nothing to copy keeps mlx-lm's
overlapped plain steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from .drafts import PromptLookup
from .policy import RowDrafts, StepTimer, Switch
from .rollback import ragged, trim_rows


@dataclass
class Counts:
    """Drafted and accepted tokens of one sequence."""

    drafted: int = 0
    accepted: int = 0


@dataclass
class Speculation:
    """What outlives one batch (the loop rebuilds it after a failed step): the
    switch, and each live sequence's counts by uid, which the loop takes when
    the sequence ends."""

    switch: Switch
    # Whether a sequence may draft, asked once when it starts decoding.
    eligible: Callable[[int], bool]
    counts: dict[int, Counts] = field(default_factory=dict)
    # Other work ran between two steps (the loop says so; see StepTimer).
    interrupted: bool = False

    def take(self, uid: int) -> Counts:
        """The counts of a sequence that ended (zeros if it never drafted)."""
        return self.counts.pop(uid, None) or Counts()

    def interrupt(self) -> None:
        """Work other than the batch's steps (a prefill chunk, an image's
        encode) runs before the next step: the step times around it say
        nothing about decoding."""
        self.interrupted = True


@dataclass
class _Row:
    lookup: PromptLookup
    drafts: RowDrafts
    counts: Counts


class SpeculativeGenerationBatch(GenerationBatch):
    """A ``GenerationBatch`` whose steps verify drafts when they pay."""

    speculation: Speculation  # set by :func:`speculative_batch`
    # mx.array or None (the base class starts them as None)
    _current_tokens: Any
    _next_tokens: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._rows: dict[int, _Row] = {}
        self._timer: StepTimer | None = None
        super().__init__(*args, **kwargs)

    def extend(self, batch: Any) -> None:
        # Rows entering decode get a cache that can roll each of them back.
        batch.prompt_cache = ragged(batch.prompt_cache)
        super().extend(batch)
        for uid, tokens in zip(batch.uids, batch.tokens, strict=True):
            if not self.speculation.eligible(uid):
                continue
            counts = self.speculation.counts.setdefault(uid, Counts())
            self._rows[uid] = _Row(PromptLookup(tokens), RowDrafts(), counts)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        live = set(self.uids)
        for uid in [uid for uid in self._rows if uid not in live]:
            del self._rows[uid]

    def next(self) -> list[Any]:
        """One step: plain (mlx-lm's, overlapped with the next) when drafting
        is not allowed (the switch's call), or no row has a draft; else a
        verifying step. Timed, by mode, by a :class:`~.policy.StepTimer`."""
        if not self.uids:
            return []
        switch, width = self.speculation.switch, len(self.uids)
        cap = switch.step_cap(width)
        drafting = cap > 0 and not switch.wants_plain_sample(width)
        timer = self._step_timer()
        timer.begin(width, drafting)
        cap = min(cap, switch.cap(width))  # what the window just closed decided
        limits = self._limits(cap) if drafting and cap else None
        if limits is None:
            responses, longest = self._plain_step(), 0
        else:
            responses, longest = self._speculate(limits)
        timer.count(len(responses), longest)
        return responses

    def _step_timer(self) -> StepTimer:
        if self._timer is None:
            self._timer = StepTimer(self.speculation.switch)
        if self.speculation.interrupted:
            self.speculation.interrupted = False
            self._timer.spoil()
        return self._timer

    # -- planning ----------------------------------------------------------------

    def _limits(self, cap: int) -> list[int] | None:
        """Each row's draft limit, or None when no row has anything to draft
        (judged from the tokens known on the host: no wait on the device)."""
        limits = [0] * len(self.uids)
        for i, uid in enumerate(self.uids):
            row = self._rows.get(uid)
            if row is None:
                continue
            room = self.max_tokens[i] - self._num_tokens[i] - 1
            limit = min(row.drafts.limit(), room, cap)
            if limit > 0 and row.lookup.propose(1):
                limits[i] = limit
        return limits if any(limits) else None

    # -- the speculative step -------------------------------------------------------

    def _speculate(self, limits: list[int]) -> tuple[list[Any], int]:
        """One step that verifies the rows' drafts, and the longest draft; 0
        with a plain step's responses when, the pending tokens read, no row
        has one."""
        pending = self._next_tokens
        mx.eval(pending)
        heads = cast(list[int], pending.tolist())
        drafts = [
            self._draft(e, limit, head) if limit else []
            for e, (limit, head) in enumerate(zip(limits, heads, strict=True))
        ]
        if not any(drafts):  # the pending tokens went elsewhere
            return self._plain_step(), 0
        width = max(len(d) for d in drafts)
        rows = [[h, *d, *[h] * (width - len(d))] for h, d in zip(heads, drafts, strict=True)]
        inputs = mx.array(rows, dtype=mx.uint32)
        logits = self.model(inputs, cache=self.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = self._sample(inputs, logits, logprobs, drafts)
        mx.eval(chosen)
        return self._settle(
            heads, drafts, [cast(list[int], c.tolist()) for c in chosen], logprobs, width
        ), width

    def _draft(self, e: int, limit: int, head: int) -> list[int]:
        """Row ``e``'s draft after its pending token ``head``, cut before any
        position its processors would steer."""
        draft = self._rows[self.uids[e]].lookup.propose(limit, (head,))
        for processor in self._processors(e):
            plan = getattr(processor, "plan_draft", None)
            draft = draft[: plan([head, *draft])] if plan is not None else []
        return draft

    def _processors(self, e: int) -> list[Any]:
        return list(self.logits_processors[e] or ()) if self.logits_processors else []

    def _plain_step(self) -> list[Any]:
        responses = GenerationBatch.next(self)
        for r in responses:
            row = self._rows.get(r.uid)
            if row is not None:
                row.lookup.append((r.token,))
        return responses

    def _sample(
        self, inputs: mx.array, logits: mx.array, logprobs: mx.array, drafts: list[list[int]]
    ) -> list[mx.array]:
        """Each row's sampled tokens: one per draft position plus one, for a
        drafting row; one (after its processors) for any other."""
        chosen = []
        for e, draft in enumerate(drafts):
            sampler = self.samplers[e] if self.samplers else self.fallback_sampler
            processors = self._processors(e)
            if not processors:
                chosen.append(sampler(logprobs[e, : len(draft) + 1]))
                continue
            # The first position as in a plain step; the draft's as the
            # processors leave them (see _draft).
            first = logits[e : e + 1, 0]
            context = self._token_context[e].update_and_fetch(inputs[e : e + 1, 0])
            rest = logits[e, 1 : len(draft) + 1]
            for processor in processors:
                first = processor(context, first)
                rest = processor.draft_logits(rest) if draft else rest
            row_logits = mx.concatenate([first, rest]) if draft else first
            chosen.append(sampler(row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)))
        return chosen

    def _settle(
        self,
        heads: list[int],
        drafts: list[list[int]],
        chosen: list[list[int]],
        logprobs: mx.array,
        width: int,
    ) -> list[Any]:
        """Accept, finish, roll back and answer, row by row."""
        responses: list[Any] = []
        rejected: list[int] = []
        keep: list[int] = []
        pending: list[int] = []
        pending_logprobs: list[mx.array] = []
        finished: list[tuple[int, Any]] = []
        for i, uid in enumerate(self.uids):
            draft, sampled = drafts[i], chosen[i]
            accepted = _agreed(draft, sampled)
            emitted, finish = self._finish([heads[i], *draft[:accepted]], i)
            self._count(uid, len(draft), len(emitted) - 1)
            self._count_in(i, emitted[1:])
            rejected.append(width + 1 - len(emitted))
            self.tokens[i].extend(emitted)
            row = self._rows.get(uid)
            if row is not None:
                row.lookup.append(emitted)
            # Each emitted token with the probabilities it was sampled from.
            sources = [self._next_logprobs[i], *(logprobs[i, j] for j in range(len(emitted) - 1))]
            for n, (token, source) in enumerate(zip(emitted, sources, strict=True)):
                reason = finish if n == len(emitted) - 1 else None
                responses.append(self.Response(uid, token, source, reason, None, None))
            if finish is not None:
                finished.append((i, responses[-1]))
            else:
                keep.append(i)
                pending.append(sampled[accepted])
                pending_logprobs.append(logprobs[i, accepted])
        trim_rows(self.prompt_cache, rejected)
        for i, response in finished:
            response.prompt_cache = self.extract_cache(i)
            response.all_tokens = self.tokens[i]
        self._current_tokens = mx.array(heads)
        if len(keep) < len(self.uids):
            self.filter(keep)
        self._next_tokens = mx.array(pending, dtype=mx.uint32) if keep else None
        self._next_logprobs = pending_logprobs
        return responses

    def _count(self, uid: int, drafted: int, accepted: int) -> None:
        row = self._rows.get(uid)
        if not drafted or row is None:
            return
        row.drafts.verified(drafted, accepted)
        row.counts.drafted += drafted
        row.counts.accepted += accepted

    def _count_in(self, i: int, drafted: list[int]) -> None:
        """Row ``i``'s processors take in its accepted draft tokens as
        generated (their contexts and step counts), as a plain step would."""
        processors = self._processors(i)
        if not drafted or not processors:
            return
        self._token_context[i].update_and_fetch(mx.array(drafted, dtype=mx.int32))
        for processor in processors:
            processor.skip(len(drafted))

    def _finish(self, emitted: list[int], i: int) -> tuple[list[int], str | None]:
        """``emitted`` up to the token that ends row ``i`` (max_tokens or a
        stop sequence), and why it ended (None: it goes on)."""
        for n, token in enumerate(emitted):
            self._num_tokens[i] += 1
            finish = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(token):
                finish = "stop"
            if finish is not None:
                return emitted[: n + 1], finish
        return emitted, None


def _agreed(draft: list[int], sampled: list[int]) -> int:
    """How many of ``draft``'s tokens the sampler drew too, from the first."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


def speculative_batch(
    model: Any, sampler: Any, speculation: Speculation
) -> SpeculativeGenerationBatch:
    """An empty speculative generation batch for ``BatchGenerator`` to extend."""
    batch = SpeculativeGenerationBatch.empty(model, sampler)
    batch.speculation = speculation
    return batch
