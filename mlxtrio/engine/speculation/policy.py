"""When to draft, and how much: per row from its recent acceptance, per batch
width from the step rates measured on this machine. Pure Python.

A draft costs a wider verification step; it pays when enough of it is accepted
and the step stays memory-bound. Neither is known in advance (it depends on the
model, the machine, the batch and what the output copies), so both are learned
while serving:

* :class:`RowDrafts`: a row drafts up to ``k`` tokens; ``k`` grows while whole
  drafts are accepted and shrinks to just past what was accepted; a row whose
  drafts keep failing pauses, longer each time;
* :class:`StepTimer`: the generated tokens per second of runs of steps taken
  in one mode (drafting allowed, or plain only) at one batch width, timed from
  one step's start to the next's, so that what a rate includes is what serving
  pays: mlx-lm's plain steps overlap their host work with the next step's
  compute, a verifying step cannot, and a drafting run mixes both (steps where
  no row has a draft stay plain): a verifying step now and then also costs
  the overlap of the plain steps around it. The first step of a run (which
  waits for the other mode's work) is not counted, nor a drafting window in
  which no step verified (it says nothing about drafts);
* :class:`Switch`: for each batch width (in buckets), moving averages of those
  rates, and a cap on every row's draft at that width. A verification step's
  cost grows with the tokens it scores: little on a GPU (decode is
  memory-bound), a lot on a CPU, where a long vocabulary or context makes a
  step compute-bound, and every row of a step verifies as many positions as
  its longest draft. So in ``auto`` each width climbs to its best cap: it
  starts at 4; where its drafting runs pay, a neighbouring cap (half or
  double) is tried now and then, and the faster of the two kept; where they
  measure slower than its plain runs, the cap halves (from below the longest
  draft it verified, so a cap its drafts never reached is skipped) if the
  narrower cap may pay as measured (at best its drafts add as many tokens,
  for less cost); else (text that copies nothing, or a cap of 1) the width
  stops drafting for a while, longer each time in a row (up to
  :data:`_MAX_COOLDOWN` steps), then measures again from 2. A cap that
  measures far slower than plain steps, with drafts that add little, is
  judged after half the usual steps: measuring a losing cap is what drafting
  costs text that copies nothing. Plain steps are measured in a short run of
  plain steps now and then. The decision follows the machine.
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
START_CAP = 4  # a width's first cap: one halving or doubling from either end
_PAUSE_AFTER_MISSES = 3  # fully rejected drafts in a row before a row pauses
_MAX_PAUSE = 64  # steps
# Moving-average weight of one step, once a rate is known: small, for a window
# of steps measures a rate to within tens of percent (what the rows copy
# changes from step to step) and the switch follows the machine, not the text
# (each row pauses its own drafts where its text stops copying).
_ALPHA = 0.02
_EXPLORE_STEPS = 32  # speculative steps measured (as one average) before a width's rate is trusted
# ... or half as many, when they already measure this much slower than plain
# steps and their drafts add less than this (what a losing cap costs while it
# is measured is what drafting costs text that copies nothing).
_CLEAR_LOSS = 1.25
_COOLDOWN_STEPS = 256  # steps before a losing width is measured again ...
_MAX_COOLDOWN = 2048  # ... doubling while it keeps losing, up to this
_PLAIN_SAMPLES = 4  # measured plain steps before a width's plain rate is trusted
_PLAIN_EVERY = 64  # then a run of plain steps per this many speculative ones
_PLAIN_RUN = 6  # steps in such a run (its first is not measured)
# Drafting must beat plain steps by this much to be kept: less is within what
# two rates measured moments apart differ by on a shared machine.
_MARGIN = 1.05
_PROBE_STEPS = 96  # speculative steps at one cap before trying a neighbour ...
_MAX_PROBE_STEPS = 768  # ... doubling while the tries lose, up to this
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
class _Average:
    """A ratio measured over windows of steps (tokens per second, tokens per
    row): the windows' average, weighted by their steps, over the first
    ``warm`` steps, a moving average after them (0.0: nothing measured).
    Averaging the windows' ratios, not pooling their parts, keeps a window
    that something else stalled (a plain run is a handful of steps) from
    outweighing the rest by its length."""

    warm: int
    value: float = 0.0
    steps: int = 0

    def add(self, part: float, whole: float, steps: int) -> None:
        ratio = part / whole
        if self.steps < self.warm:
            self.value += (ratio - self.value) * steps / (self.steps + steps)
        else:
            self.value += (1 - (1 - _ALPHA) ** steps) * (ratio - self.value)
        self.steps += steps


@dataclass
class _AtCap:
    """Drafting steps measured at one cap."""

    cap: int  # the most tokens a row drafts
    rate: _Average = field(default_factory=lambda: _Average(_EXPLORE_STEPS))
    longest: int = 0  # the longest draft verified
    # Tokens accepted from drafts per row and step: the share drafts add.
    gain: _Average = field(default_factory=lambda: _Average(_EXPLORE_STEPS))

    def add(self, width: int, tokens: int, seconds: float, steps: int, longest: int) -> None:
        self.rate.add(tokens, seconds, steps)
        self.longest = max(self.longest, longest)
        self.gain.add(max(0, tokens - steps * width), steps * width, steps)


@dataclass
class _Rates:
    """One width bucket's measurements, and its cap: a hill climb over caps
    (8, 4, 2, 1) on the drafting rate, against the plain rate."""

    plain_rate: _Average = field(default_factory=lambda: _Average(_EXPLORE_STEPS))
    drafting: _AtCap = field(default_factory=lambda: _AtCap(START_CAP))
    cooldown: int = 0  # steps left before speculating again
    next_cooldown: int = _COOLDOWN_STEPS
    since_plain: int = 0  # speculative steps since the last plain measurement
    plain_run: int = 0  # steps left in a run of plain steps asked for
    # While another cap is tried: the cap it is tried against, as measured.
    incumbent: _AtCap | None = None
    since_probe: int = 0  # speculative steps at this cap since the last try
    probe_every: int = _PROBE_STEPS  # doubles while tries lose
    narrower: bool = False  # which neighbour to try next (wider first)

    @property
    def cap(self) -> int:
        return self.drafting.cap

    @property
    def plain(self) -> float:
        return self.plain_rate.value

    @property
    def speculative(self) -> float:
        return self.drafting.rate.value

    @property
    def speculative_steps(self) -> int:
        return self.drafting.rate.steps

    def start_over(self, cap: int) -> None:
        self.drafting, self.since_probe = _AtCap(cap), 0

    def trusted(self) -> bool:
        """Whether the current cap's rate is measured well enough to judge:
        after :data:`_EXPLORE_STEPS`, or half as many where drafting measures
        a clear loss and its drafts add too little for that to be noise (where
        they add much, a short measurement's bad luck would cost a rest)."""
        steps, plain = self.speculative_steps, self.plain
        if not plain or steps < _EXPLORE_STEPS // 2:
            return False
        clear = _CLEAR_LOSS * self.speculative < plain
        return steps >= _EXPLORE_STEPS or clear and 1 + self.drafting.gain.value < _CLEAR_LOSS

    def _may_pay(self, cap: int, reached: int) -> bool:
        """Whether drafting at most ``cap`` tokens may beat plain steps, where
        drafts of up to ``reached`` measured slower, if its drafts add as many
        tokens (at most: shorter drafts add fewer) and what a drafting step
        costs beyond a plain one shrinks in proportion to the drafted
        positions (roughly: on a CPU the cost of long drafts grows faster than
        that, and a verifying step of any length loses mlx-lm's overlap). So
        where the drafts added little (text that copies nothing), no narrower
        cap is tried."""
        if not self.speculative:
            return False
        gain = 1 + self.drafting.gain.value
        cost = gain * self.plain / self.speculative  # a drafting step's, a plain one's 1
        return gain / (1 + (cost - 1) * cap / reached) >= _MARGIN

    def judge(self) -> None:
        """The current cap's rate is known: keep it, try a neighbour, go back
        to the one it was tried against, or stop drafting for a while."""
        if self.incumbent is not None:  # a neighbour was tried: keep the faster
            incumbent, self.incumbent = self.incumbent, None
            if incumbent.rate.value >= self.speculative:
                self.narrower = not self.narrower  # the other side, next time
                self.probe_every = min(_MAX_PROBE_STEPS, 2 * self.probe_every)
                self.drafting, self.since_probe = incumbent, 0
                return
            self.probe_every = _PROBE_STEPS
        if self.speculative < _MARGIN * self.plain:
            self._lose()
            return
        self.next_cooldown = _COOLDOWN_STEPS  # it pays here (again)
        if self.since_probe >= self.probe_every:
            self._try_neighbour()

    def _try_neighbour(self) -> None:
        cap = self.cap  # caps: 8, 4, 2, 1
        wider = cap * 2 if self.drafting.longest >= cap < MAX_DRAFT else 0
        narrower = cap // 2
        if not (narrower if self.narrower else wider):
            self.narrower = not self.narrower
        target = narrower if self.narrower else wider
        if target:
            self.incumbent = self.drafting
            self.start_over(target)
        else:
            self.since_probe = 0

    def _lose(self) -> None:
        """Drafting measured slower than plain steps at this cap: the next
        cap of 8, 4, 2, 1 below what the drafts reached, if it may pay; else
        a rest."""
        reached = min(self.cap, self.drafting.longest)
        cap = 1 << ((reached - 1).bit_length() - 1) if reached > 1 else 0
        if cap >= 1 and self._may_pay(cap, reached):
            self.start_over(cap)
            return
        # No narrower cap may pay here: rest, then retry.
        self.cooldown = self.next_cooldown
        self.next_cooldown = min(_MAX_COOLDOWN, 2 * self.next_cooldown)
        self.start_over(2)


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
            return START_CAP
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
        """Whether a step that may draft should rather be a plain one: while
        drafting is allowed, the plain rate is known only from runs of plain
        steps asked for now and then (a run, because a lone plain step between
        speculative ones cannot be timed: its compute overlaps the next step)."""
        if self.mode != "auto":
            return False
        rates = self.rates.setdefault(_bucket(width), _Rates())
        if rates.plain_run:
            rates.plain_run -= 1
            return True
        if rates.plain_rate.steps < _PLAIN_SAMPLES or rates.since_plain >= _PLAIN_EVERY:
            rates.plain_run = _PLAIN_RUN - 1
            rates.since_plain = 0
            return True
        return False

    def observe(
        self,
        width: int,
        tokens: int,
        seconds: float,
        speculative: bool,
        steps: int = 1,
        longest: int | None = None,
    ) -> None:
        """``steps`` generation steps of ``width`` rows emitted ``tokens`` in
        ``seconds``; ``speculative``: with drafting allowed, the longest draft
        verified among them ``longest`` tokens (None: as long as the cap)."""
        if seconds <= 0 or steps <= 0 or width <= 0:
            return
        rates = self.rates.setdefault(_bucket(width), _Rates())
        if not speculative:
            rates.plain_rate.add(tokens, seconds, steps)
            return
        rates.since_plain += steps
        rates.since_probe += steps
        rates.drafting.add(width, tokens, seconds, steps, rates.cap if longest is None else longest)
        if self.mode != "auto" or not rates.trusted():
            return
        log.debug(
            "speculation: width %d, at most %d drafted: %.1f tok/s against %.1f plain"
            " (drafts added %.0f %%)",
            width,
            rates.cap,
            rates.speculative,
            rates.plain,
            100 * rates.drafting.gain.value,
        )
        rates.judge()

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
    """Times a batch's steps in runs for :meth:`Switch.observe`.

    A run is consecutive steps taken in one mode (drafting allowed or not) at
    one batch width; its steps are timed from one's start to the next's, in
    windows of a few steps. A run's first step is not counted (the first step
    allowed to draft may wait for plain steps' last compute; a plain step
    after a verifying one only starts its compute), nor is a window that other
    work came into (:meth:`spoil`: a prefill chunk, an image's encode), nor a
    drafting window in which no step verified a draft.
    """

    switch: Switch
    clock: Callable[[], float] = time.perf_counter
    _run: tuple[int, bool] | None = None  # (width, drafting allowed)
    _mark: float | None = None  # when the window's first counted step started
    _tokens: int = 0
    _steps: int = 0
    _longest: int = 0  # the longest draft verified in the window
    _spoiled: bool = False

    def begin(self, width: int, drafting: bool) -> None:
        """A step of ``width`` rows is about to run, allowed to draft or not."""
        now = self.clock()
        run = (width, drafting)
        if self._spoiled or run != self._run:
            self._close(now)
            self._run, self._spoiled = run, False
        elif self._mark is None or self._steps >= _WINDOW:
            self._close(now)
            self._mark = now

    def count(self, tokens: int, drafted: int = 0) -> None:
        """The step begun last emitted ``tokens``, verifying drafts of at most
        ``drafted`` tokens (0: a plain step)."""
        if self._mark is not None:
            self._tokens += tokens
            self._steps += 1
            self._longest = max(self._longest, drafted)

    def spoil(self) -> None:
        """Other work than this batch's steps ran since the last step began."""
        self._spoiled = True

    def _close(self, now: float) -> None:
        mark, run = self._mark, self._run
        if mark is not None and run is not None and not self._spoiled:
            width, drafting = run
            if self._steps >= _MIN_WINDOW and (not drafting or self._longest):
                self.switch.observe(
                    width, self._tokens, now - mark, drafting, self._steps, self._longest
                )
        self._mark, self._tokens, self._steps, self._longest = None, 0, 0, 0
