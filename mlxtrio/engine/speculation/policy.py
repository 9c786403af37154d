"""When to draft, and how much: per row from its recent acceptance, per batch
width from the step rates measured on this machine. Pure Python.

A draft costs a wider verification step; it pays when enough of it is accepted
and the step stays memory-bound. Neither is known in advance (it depends on the
model, the machine, the batch and what the output copies), so both are learned
while serving:

* :class:`RowDrafts`: a row drafts up to ``k`` tokens; ``k`` grows while whole
  drafts are accepted and shrinks to just past what was accepted; a row whose
  drafts keep failing pauses, longer each time;
* :class:`StepTimer`: the generated tokens per second of runs of like steps
  (plain or speculative, one batch width), timed from one step's start to the
  next's, so that what a rate includes is what serving pays: mlx-lm's plain
  steps overlap their host work with the next step's compute, speculative
  steps cannot, and the first step of a run (which waits for the other kind's
  work) is not counted;
* :class:`Switch`: for each batch width (in buckets), moving averages of those
  rates, and a cap on every row's draft at that width. A verification step's
  cost grows with the tokens it scores: little on a GPU (decode is
  memory-bound), a lot on a CPU at a long context. So in ``auto``, where a
  width's speculative steps measure slower than its plain ones, its cap halves
  (8, 4, 2, 1); slower still at 1, the width stops drafting for a while, then
  measures again from 2; where they measure well ahead, the cap is tried
  doubled now and then. Plain steps are measured where they happen and, while
  every step could draft, in a short run of plain steps now and then. The
  decision follows the machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("mlxtrio.engine")

MODES = ("auto", "on", "off")
MAX_DRAFT = 8
START_DRAFT = 4
_PAUSE_AFTER_MISSES = 3  # fully rejected drafts in a row before a row pauses
_MAX_PAUSE = 64  # steps
_ALPHA = 0.1  # moving-average weight of one step
_EXPLORE_STEPS = 16  # speculative steps measured before a width's rate is trusted
_COOLDOWN_STEPS = 256  # steps before a losing width is measured again
_PLAIN_SAMPLES = 4  # measured plain steps before a width's plain rate is trusted
_PLAIN_EVERY = 64  # then a run of plain steps per this many speculative ones
_PLAIN_RUN = 6  # steps in such a run (its first is not measured)
# Drafting must beat plain steps by this much to be kept: less is within what
# two rates measured moments apart differ by on a shared machine.
_MARGIN = 1.05
_AHEAD = 1.2  # speculative steps this much faster still: wider drafts may pay
_PROBE_STEPS = 64  # speculative steps at one cap before trying a wider one
_WINDOW = 8  # steps per measurement of a run
_MIN_WINDOW = 3  # fewer measured steps say too little (a run cut short)


@dataclass
class RowDrafts:
    """One row's draft length, adapted to its recent acceptance."""

    k: int = START_DRAFT
    misses: int = 0
    paused: int = 0  # steps left without drafting
    pause: int = 4  # the next pause's length

    def limit(self) -> int:
        """How many tokens to draft this step (0 while paused)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def verified(self, drafted: int, accepted: int) -> None:
        """Learn from one verification of ``drafted`` tokens."""
        if accepted == drafted:
            self.k = min(MAX_DRAFT, self.k + 2)
            self.misses = 0
            self.pause = 4
            return
        self.k = max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= _PAUSE_AFTER_MISSES:
            self.paused, self.pause = self.pause, min(_MAX_PAUSE, self.pause * 2)
            self.misses = 0


@dataclass
class _Rates:
    plain: float = 0.0  # tokens per second, moving average (0: not measured)
    speculative: float = 0.0  # ... of speculative steps at the current cap
    speculative_steps: int = 0  # ... measured at the current cap
    cooldown: int = 0  # steps left before speculating again
    cap: int = MAX_DRAFT  # the most tokens a row drafts at this width
    plain_samples: int = 0
    since_plain: int = 0  # speculative steps since the last plain measurement
    plain_run: int = 0  # steps left in a run of plain steps asked for

    def start_over(self, cap: int) -> None:
        self.cap, self.speculative, self.speculative_steps = cap, 0.0, 0


def _bucket(width: int) -> int:
    """Batch widths measured together: 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(width - 1, 0).bit_length()


@dataclass
class Switch:
    """Whether the next step of a batch this wide may verify drafts."""

    mode: str = "auto"
    rates: dict[int, _Rates] = field(default_factory=dict)

    def allows(self, width: int) -> bool:
        return self.cap(width) > 0

    def cap(self, width: int) -> int:
        """The most tokens a row of a batch this wide may draft (0: none)."""
        if self.mode != "auto":
            return MAX_DRAFT if self.mode == "on" else 0
        rates = self.rates.get(_bucket(width))
        if rates is None:
            return MAX_DRAFT
        return rates.cap if rates.cooldown == 0 else 0

    def step_cap(self, width: int) -> int:
        """:meth:`cap` for the step about to run (a width resting from
        drafting counts it)."""
        rates = self.rates.get(_bucket(width))
        if self.mode == "auto" and rates is not None and rates.cooldown:
            rates.cooldown -= 1
            return 0
        return self.cap(width)

    def wants_plain_sample(self, width: int) -> bool:
        """Whether a step that could verify drafts should rather be a plain
        one: while every step could draft, the plain rate is known only from
        runs of plain steps asked for now and then (a run, because a lone plain
        step between speculative ones cannot be timed: its compute overlaps
        the next step)."""
        if self.mode != "auto":
            return False
        rates = self.rates.setdefault(_bucket(width), _Rates())
        if rates.plain_run:
            rates.plain_run -= 1
            return True
        if rates.plain_samples < _PLAIN_SAMPLES or rates.since_plain >= _PLAIN_EVERY:
            rates.plain_run = _PLAIN_RUN - 1
            rates.since_plain = 0
            return True
        return False

    def observe(
        self, width: int, tokens: int, seconds: float, speculative: bool, steps: int = 1
    ) -> None:
        """``steps`` generation steps of ``width`` rows emitted ``tokens`` in ``seconds``."""
        if seconds <= 0 or steps <= 0:
            return
        rates = self.rates.setdefault(_bucket(width), _Rates())
        rate = tokens / seconds
        weight = 1 - (1 - _ALPHA) ** steps
        if not speculative:
            rates.plain = rate if not rates.plain else rates.plain + weight * (rate - rates.plain)
            rates.plain_samples += steps
            return
        rates.since_plain += steps
        rates.speculative_steps += steps
        if not rates.speculative:
            rates.speculative = rate
        else:
            rates.speculative += weight * (rate - rates.speculative)
        trusted = rates.speculative_steps >= _EXPLORE_STEPS and rates.plain
        if self.mode != "auto" or not trusted:
            return
        if rates.speculative < _MARGIN * rates.plain:
            log.debug(
                "speculation: width %d, at most %d drafted: %.1f tok/s against %.1f plain",
                width,
                rates.cap,
                rates.speculative,
                rates.plain,
            )
            if rates.cap > 1:
                rates.start_over(rates.cap // 2)
            else:  # not even one drafted token pays here: rest, then retry
                rates.cooldown = _COOLDOWN_STEPS
                rates.start_over(2)
        elif (
            rates.speculative > _AHEAD * _MARGIN * rates.plain
            and rates.cap < MAX_DRAFT
            and rates.speculative_steps >= _PROBE_STEPS
        ):
            rates.start_over(rates.cap * 2)  # try wider drafts again

    def describe(self) -> dict[str, dict[str, float]]:
        """Measured rates per batch-width bucket (for /health)."""
        out = {}
        for bucket, rates in sorted(list(self.rates.items())):  # read from the Trio thread
            low, high = (1 << (bucket - 1)) + 1 if bucket else 1, 1 << bucket
            name = str(high) if low == high else f"{low}-{high}"
            out[name] = {
                "plain_tokens_per_second": round(rates.plain, 1),
                "speculative_tokens_per_second": round(rates.speculative, 1),
                "drafting": rates.cooldown == 0,
                "max_draft": rates.cap if rates.cooldown == 0 else 0,
            }
        return out


@dataclass
class StepTimer:
    """Times a batch's steps in runs of like steps for :meth:`Switch.observe`.

    A run is consecutive steps of one kind (plain or speculative) at one batch
    width; its steps are timed from one's start to the next's, in windows of
    a few steps. A run's first step is not counted (a speculative step after
    plain ones first waits for their last compute; a plain step after a
    speculative one only starts its compute), nor is a window that other work
    came into (:meth:`spoil`: a prefill chunk, an image's encode).
    """

    switch: Switch
    clock: Callable[[], float] = time.perf_counter
    _run: tuple[int, bool] | None = None  # (width, speculative)
    _mark: float | None = None  # when the window's first counted step started
    _tokens: int = 0
    _steps: int = 0
    _spoiled: bool = False

    def begin(self, width: int, speculative: bool) -> None:
        """A step of ``width`` rows is about to run."""
        now = self.clock()
        run = (width, speculative)
        if self._spoiled or run != self._run:
            self._close(now)
            self._run, self._spoiled = run, False
        elif self._mark is None or self._steps >= _WINDOW:
            self._close(now)
            self._mark = now

    def count(self, tokens: int) -> None:
        """The step begun last emitted ``tokens``."""
        if self._mark is not None:
            self._tokens += tokens
            self._steps += 1

    def spoil(self) -> None:
        """Other work than this batch's steps ran since the last step began."""
        self._spoiled = True

    def _close(self, now: float) -> None:
        if self._mark is not None and not self._spoiled and self._steps >= _MIN_WINDOW:
            assert self._run is not None
            width, speculative = self._run
            self.switch.observe(width, self._tokens, now - self._mark, speculative, self._steps)
        self._mark, self._tokens, self._steps = None, 0, 0
