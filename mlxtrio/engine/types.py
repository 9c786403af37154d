"""Plain data exchanged between the Trio side and the engine thread.

Nothing here imports MLX: these objects cross the thread boundary and are read by
the API layer.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]

# The prefix cache's unit: a prompt's KV is cut into blocks of this many
# tokens (see .cache.blocks).
BLOCK_TOKENS = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # OpenAI-style additive penalties over the generated tokens (-2..2; 0 = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    # Any 64-bit integer (signed or unsigned); the engine maps it onto a PRNG key.
    seed: int | None = None
    # Extra token ids that end generation like EOS does (not shown in the text).
    stop_token_ids: tuple[int, ...] = ()
    # Close an open reasoning block after this many generated tokens (Anthropic
    # thinking.budget_tokens). Only for prompts that start inside reasoning.
    reasoning_budget: int | None = None
    # What the output must look like: texts it must go on with at given points
    # (tool-call openings), grammars it must follow (tool-call bodies,
    # structured output).
    constraints: tuple[TextConstraint | GrammarConstraint, ...] = ()


@dataclass(frozen=True)
class TextConstraint:
    """The output must go on with one of ``openings``: from the first generated
    token (``after`` None), or right after token ``after`` is generated: its first
    time only, or every time when ``repeat`` (e.g. after each tool-call marker)."""

    openings: tuple[str, ...]
    after: int | None = None
    repeat: bool = False


@dataclass(frozen=True)
class GrammarConstraint:
    """The output must follow a compiled grammar (an llguidance matcher in its
    initial state, from :class:`~mlxtrio.grammar.compiler.GrammarCompiler`):
    from the first generated token (``after`` None) or right after token
    ``after``, every time when ``repeat``, until the grammar is complete (its
    last token: a call's closing marker, or EOS)."""

    grammar: Any
    after: int | None = None
    repeat: bool = False
    # The grammar's llguidance Lark text: other ranks of a distributed model
    # compile their own copy from it.
    source: str = ""


@dataclass
class GenerationStats:
    """Counters and timings of one sequence; complete once it has finished."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    # Seconds from submit() to the first generated token.
    time_to_first_token: float | None = None
    prefill_tokens_per_second: float | None = None
    decode_tokens_per_second: float | None = None
    # Seconds spent waiting in the engine before prefill started.
    queue_seconds: float = 0.0
    # Prompt tokens actually run through the model (prompt - cached, or fewer
    # when cancelled during prefill).
    prefilled_tokens: int = 0
    # Speculative decoding: tokens drafted, and how many of them the model
    # agreed with (each one a token generated without a step of its own).
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class GenerationEvent:
    """What one engine step produced for one sequence.

    ``text`` is the detokenized delta (may be empty while a multi-byte character
    is incomplete). The last event of a sequence has ``finish_reason`` set and
    carries the final ``stats``.
    """

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    error: str | None = None

    @classmethod
    def final(cls, reason: FinishReason, stats: GenerationStats) -> GenerationEvent:
        """A last event that carries no token (a cancelled sequence's)."""
        return cls(finish_reason=reason, stats=stats)

    @classmethod
    def failure(cls, message: str) -> GenerationEvent:
        return cls(error=message)


@dataclass
class LoadProgress:
    """How far a model's load has got: bytes of weights read so far, of the
    total (written by the engine thread, read by ``/health``)."""

    total_bytes: int = 0
    done_bytes: int = 0
    started: float | None = None  # time.monotonic() when the load began


_LATENCY_HISTORY = 256  # cancel latencies kept


@dataclass
class EngineStats:
    """Engine-wide counters, read by tests, /health and /metrics."""

    steps: int = 0
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    max_batch_size: int = 0  # most sequences decoded in one step
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # Requests that waited for a running sequence's KV instead of prefilling it.
    inflight_waits: int = 0
    # Bytes MLX's arrays held when the engine last went idle.
    mlx_active_bytes: int = 0
    # Steps between cancel() and removal, most recent last (bounded).
    cancel_latency_steps: list[int] = field(default_factory=list)
    # What the most recently cancelled sequence had done when it was removed.
    last_cancelled: GenerationStats | None = None
    # Speculative decoding: the mode in force ("auto", "on", or "off" with why),
    # its switch (measured rates, see .speculation.policy), and the totals of
    # the sequences that ended.
    speculation: str = "off"
    speculation_switch: Any = None
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def note_cancelled(self, stats: GenerationStats, requested_at_step: int | None) -> None:
        """Count a cancelled sequence and, when its cancel was timed, how many
        steps its removal took."""
        self.cancelled += 1
        if requested_at_step is not None:
            self.cancel_latency_steps.append(self.steps - requested_at_step)
            del self.cancel_latency_steps[:-_LATENCY_HISTORY]
        self.last_cancelled = stats


# -- prefix-cache entries and matches (see .cache.prefix_index) --------------


@dataclass
class Entry:
    id: int
    key: Hashable  # (model, domain)
    tokens: list[int]
    nbytes: int  # its own KV: the tail after its blocks, or the whole cache
    trimmable: bool
    pins: int = 0
    blocks: tuple[bytes, ...] = ()  # names of the shared blocks it starts with
    block_nbytes: int = 0  # bytes of one block


@dataclass
class Match:
    """A reusable prefix of ``length`` tokens: the first tokens of ``entry`` (if
    any), then the ``disk`` blocks, read from disk into ``loaded`` before the
    sequence starts."""

    entry: Entry | None
    length: int
    disk: tuple[bytes, ...] = ()
    loaded: list[Any] | None = field(default=None, repr=False)  # the engine clears it
    loaded_nbytes: int = 0
    # Tokens ``entry`` and ``disk`` hold when more than ``length`` are (a
    # match cut back to where an image starts); the cache built from them is
    # trimmed to ``length``. 0: ``length``.
    extent: int = 0
    _released: bool = field(default=False, repr=False)

    @property
    def memory_length(self) -> int:
        """Tokens taken from ``entry``."""
        return (self.extent or self.length) - len(self.disk) * BLOCK_TOKENS
