"""Size each prefill chunk by time, not by a token count.

mlx-lm's ``BatchGenerator.next()`` runs one decode step for the running batch and
then one prefill chunk for the prompts being processed. That chunk decides how
long every running stream waits for its next token, and how late a hang-up is
noticed (commands are applied between steps). A fixed token count is wrong at
both ends: at 16k tokens of context a 512-token chunk took 2.5-6 s on a 2-core
machine, while at 1k it is over in a fraction of that.

:class:`PrefillPacer` learns the cost per prompt token as a function of the
context length and picks the chunk that fits a time budget (the idea of
Sarathi-Serve's stall-free batching). Attention makes a token's cost grow with
the context it attends to, so the model is ``seconds/token = u * (context + K)``:
one learned factor ``u`` (a moving average over recent chunks), and a constant
``K`` standing for the context-independent work (the weights' matrix products),
which makes the extrapolation to a longer context err on the small side.

Pure arithmetic; used on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

# Context-independent work per token, in tokens of attention. Smaller values
# predict a steeper growth with the context (safer, smaller chunks).
_FIXED_WORK_TOKENS = 2048
_SMOOTHING = 0.5  # weight of the newest observation in the moving average
_GRAIN = 16  # chunks above this are multiples of it (friendlier matrix shapes)
SOLO_FACTOR = 4  # a step's budget when no stream waits for it, in budgets


@dataclass
class PrefillPacer:
    """``budget``: seconds of prefill per engine step; chunks stay within
    [``min_chunk``, ``max_chunk``] tokens (a chunk below the minimum would make
    no useful progress; the maximum bounds memory). Before any measurement the
    chunk is ``first_chunk``."""

    budget: float
    max_chunk: int
    min_chunk: int = 16
    first_chunk: int = 64
    _unit_cost: float | None = None  # ``u`` above, seconds per token per context token

    def chunk(self, context: int, rows: int = 1, decoding: bool = True) -> int:
        """Tokens per prompt for the next step, when ``rows`` prompts are being
        prefilled together and the longest is at ``context`` tokens.
        ``decoding``: other sequences are generating, and wait for this step;
        when none are, the step may take :data:`SOLO_FACTOR` times the budget
        (small chunks cost a step's fixed work each time: a warm agent turn of
        ~150 new tokens took 3.2 s at 0.25 s a step, 2.4 s at 1 s, measured on
        a 29 M-parameter model on 2 cores), and only a hang-up waits longer."""
        if self._unit_cost is None:
            tokens = self.first_chunk
        else:
            per_token = self._unit_cost * (context + _FIXED_WORK_TOKENS)
            budget = self.budget if decoding else self.budget * SOLO_FACTOR
            tokens = int(budget / (per_token * max(rows, 1)))
        if tokens > _GRAIN:
            tokens -= tokens % _GRAIN
        return max(min(self.min_chunk, self.max_chunk), min(self.max_chunk, tokens))

    def observe(self, tokens: int, seconds: float, context: int) -> None:
        """Learn from a step that prefilled ``tokens`` tokens (all rows together)
        in ``seconds``, attending to ``context`` tokens on average."""
        if tokens <= 0 or seconds <= 0:
            return
        unit = seconds / tokens / (context + _FIXED_WORK_TOKENS)
        if self._unit_cost is None:
            self._unit_cost = unit
        else:
            self._unit_cost += _SMOOTHING * (unit - self._unit_cost)
