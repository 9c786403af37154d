"""Whether the engine loop speculates for its model, and settling a sequence's
draft counts when it ends (engine thread only)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..types import EngineStats, GenerationStats
from .policy import Switch
from .rollback import model_rolls_back
from .verify import Speculation

log = logging.getLogger("mlxtrio.engine")


def speculation_for(
    model: Any,
    mode: str,
    stats: EngineStats,
    eligible: Callable[[int], bool],
    *,
    strict: bool,
) -> Speculation | None:
    """Speculative decoding for ``model`` in ``mode`` (auto, on, off), unless
    it is off or cannot be exact here; the reason goes to the log and to
    ``stats.speculation`` (shown in /health). The switch lives in ``stats`` so
    that what it measured outlives a rebuilt loop."""
    stats.speculation = mode
    if mode == "off":
        return None
    reason = _why_not(model, strict)
    if reason is not None:
        log.info("speculative decoding off: %s", reason)
        stats.speculation = f"off: {reason}"
        return None
    switch = stats.speculation_switch
    if not isinstance(switch, Switch) or switch.mode != mode:
        switch = stats.speculation_switch = Switch(mode)
    return Speculation(switch, eligible)


def _why_not(model: Any, strict: bool) -> str | None:
    if getattr(model, "serial", False):
        return "not on the serial path (a model that attends to images by cross-attention)"
    if strict:
        return "not across ranks yet: every rank would have to verify the same drafts"
    if not model_rolls_back(model):
        return "the model's KV cache cannot roll back one row (rotating or recurrent layers)"
    return None


def settle_counts(
    speculation: Speculation | None, uid: int, seq_stats: GenerationStats, totals: EngineStats
) -> None:
    """Move an ending sequence's draft counts into its stats and the totals."""
    if speculation is None:
        return
    counts = speculation.take(uid)
    seq_stats.draft_tokens, seq_stats.accepted_tokens = counts.drafted, counts.accepted
    totals.draft_tokens += counts.drafted
    totals.accepted_tokens += counts.accepted
