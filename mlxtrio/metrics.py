"""Prometheus metrics. Live values (queue depth, running sequences, token totals)
are read from the engines and lanes at scrape time by a custom collector, so the
engine thread never touches prometheus objects."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# (name, help, kind, value) read live from each model's engine and admission lane.
_LIVE: list[tuple[str, str, str, Callable[[Any, Any], float]]] = [
    (
        "mlxtrio_active_sequences",
        "Sequences in the engine (prefill or decode)",
        "gauge",
        lambda e, lane: e.active_sequences,
    ),
    (
        "mlxtrio_queued_requests",
        "Requests waiting for an admission slot",
        "gauge",
        lambda e, lane: lane.waiting,
    ),
    (
        "mlxtrio_generated_tokens",
        "Tokens generated",
        "counter",
        lambda e, lane: e.stats.generated_tokens,
    ),
    (
        "mlxtrio_speculation_draft_tokens",
        "Tokens drafted for speculative decoding (sequences that ended)",
        "counter",
        lambda e, lane: e.stats.draft_tokens,
    ),
    (
        "mlxtrio_speculation_accepted_tokens",
        "Drafted tokens the model agreed with (generated without a step of their own)",
        "counter",
        lambda e, lane: e.stats.accepted_tokens,
    ),
    (
        "mlxtrio_prompt_tokens",
        "Prompt tokens of started sequences",
        "counter",
        lambda e, lane: e.stats.prompt_tokens,
    ),
    ("mlxtrio_engine_steps", "Engine steps", "counter", lambda e, lane: e.stats.steps),
    (
        "mlxtrio_cancelled_sequences",
        "Sequences cancelled before they finished",
        "counter",
        lambda e, lane: e.stats.cancelled,
    ),
    (
        "mlxtrio_prefix_cache_hits",
        "Requests that reused a cached prefix",
        "counter",
        lambda e, lane: e.cache.index.stats.hits,
    ),
    (
        "mlxtrio_prefix_cache_cached_tokens",
        "Prompt tokens served from the prefix cache",
        "counter",
        lambda e, lane: e.cache.index.stats.cached_tokens,
    ),
    (
        "mlxtrio_prefix_cache_evictions",
        "Snapshots evicted for the byte budget",
        "counter",
        lambda e, lane: e.cache.index.stats.evictions,
    ),
    (
        "mlxtrio_prefix_cache_bytes",
        "Bytes of KV snapshots held",
        "gauge",
        lambda e, lane: e.cache.index.nbytes,
    ),
    (
        "mlxtrio_prefix_cache_entries",
        "KV snapshots held",
        "gauge",
        lambda e, lane: len(e.cache.index),
    ),
    (
        "mlxtrio_prefix_cache_shared_blocks",
        "256-token KV blocks held in memory (each once, however many snapshots share it)",
        "gauge",
        lambda e, lane: e.cache.index.shared_blocks,
    ),
    (
        "mlxtrio_prefix_cache_disk_bytes",
        "Bytes of KV block files in the disk tier",
        "gauge",
        lambda e, lane: e.cache.index.disk.nbytes if e.cache.index.disk else 0,
    ),
    (
        "mlxtrio_prefix_cache_disk_blocks",
        "KV block files in the disk tier",
        "gauge",
        lambda e, lane: len(e.cache.index.disk) if e.cache.index.disk else 0,
    ),
    (
        "mlxtrio_mlx_active_bytes",
        "Bytes MLX's arrays held (weights, prefix-cache KV) when the engine last went idle",
        "gauge",
        lambda e, lane: e.stats.mlx_active_bytes,
    ),
    (
        "mlxtrio_prefix_cache_inflight_waits",
        "Requests that waited for a running sequence's KV instead of prefilling it",
        "counter",
        lambda e, lane: e.stats.inflight_waits,
    ),
]


class _LiveCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[tuple[str, Any, Any]]]) -> None:
        self._sources = sources  # -> (model, engine, lane)

    def collect(self) -> Iterator[Metric]:
        sources = list(self._sources())
        for name, doc, kind, value in _LIVE:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(name, doc, labels=["model"])
            for model, engine, lane in sources:
                family.add_metric([model], value(engine, lane))
            yield family


class Metrics:
    def __init__(self, sources: Callable[[], Iterable[tuple[str, Any, Any]]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlxtrio_requests",
            "HTTP requests by route and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "mlxtrio_time_to_first_token_seconds",
            "Time from submit to the first generated token",
            ["model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.cache_misses = Counter(
            "mlxtrio_prefix_cache_misses",
            "Requests that reused less than their session's previous turn offered, by "
            "cause: new_conversation, divergence, eviction, other_model",
            ["model", "cause"],
            registry=self.registry,
        )
        self.registry.register(_LiveCollector(sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)
