"""How an engine serves its model: one value, built from the server's
settings in one place (:meth:`EngineConfig.from_settings`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..settings import Settings


@dataclass(frozen=True)
class EngineConfig:
    # Sequences decoded at once (0 = auto from the model and the memory: see .sizing).
    capacity: int = 0
    # Prefill is paced by time: each step prefills for about
    # ``prefill_step_seconds``, in chunks of at most ``prefill_chunk`` tokens.
    prefill_chunk: int = 2048
    prefill_step_seconds: float = 0.25
    default_max_tokens: int = 4096
    # Prefix KV cache budgets in bytes (0 = off), and where the disk tier lives.
    prefix_cache_bytes: int = 0
    prefix_cache_disk_bytes: int = 0
    cache_dir: Path | None = None
    compute_dtype: str = "model"  # see .precision
    context_limit: int = 0  # tokens served, when less than the model's own
    # A model served across ranks: how it is sharded, how long a lock-step
    # round may go unanswered, how long its ranks get to stop.
    sharding: str = "auto"
    rank_timeout: float = 60.0
    shutdown_grace: float = 5.0
    speculation: str = "off"  # auto, on, off (see .speculation.policy)

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(
            capacity=settings.capacity,
            prefill_chunk=settings.prefill_chunk,
            prefill_step_seconds=settings.prefill_step_seconds,
            default_max_tokens=settings.default_max_tokens,
            prefix_cache_bytes=settings.prefix_cache_budget,
            prefix_cache_disk_bytes=settings.prefix_cache_disk_budget,
            cache_dir=settings.kv_cache_path,
            compute_dtype=settings.compute_dtype,
            context_limit=settings.context_length,
            sharding=settings.sharding,
            rank_timeout=settings.rank_timeout,
            shutdown_grace=settings.shutdown_grace,
            speculation=settings.speculation,
        )
