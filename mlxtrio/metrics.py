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


class _LiveCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[tuple[str, Any, Any]]]) -> None:
        self._sources = sources  # -> (model, engine, lane)

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "mlxtrio_active_sequences",
            "Sequences in the engine (prefill or decode)",
            labels=["model"],
        )
        queued = GaugeMetricFamily(
            "mlxtrio_queued_requests", "Requests waiting for an admission slot", labels=["model"]
        )
        generated = CounterMetricFamily(
            "mlxtrio_generated_tokens", "Tokens generated", labels=["model"]
        )
        prompt = CounterMetricFamily(
            "mlxtrio_prompt_tokens", "Prompt tokens of started sequences", labels=["model"]
        )
        steps = CounterMetricFamily("mlxtrio_engine_steps", "Engine steps", labels=["model"])
        cancelled = CounterMetricFamily(
            "mlxtrio_cancelled_sequences",
            "Sequences cancelled before they finished",
            labels=["model"],
        )
        cache_hits = CounterMetricFamily(
            "mlxtrio_prefix_cache_hits", "Requests that reused a cached prefix", labels=["model"]
        )
        cache_misses = CounterMetricFamily(
            "mlxtrio_prefix_cache_misses", "Requests with no reusable prefix", labels=["model"]
        )
        cache_tokens = CounterMetricFamily(
            "mlxtrio_prefix_cache_cached_tokens",
            "Prompt tokens served from the prefix cache",
            labels=["model"],
        )
        cache_evictions = CounterMetricFamily(
            "mlxtrio_prefix_cache_evictions",
            "Snapshots evicted for the byte budget",
            labels=["model"],
        )
        cache_bytes = GaugeMetricFamily(
            "mlxtrio_prefix_cache_bytes", "Bytes of KV snapshots held", labels=["model"]
        )
        cache_entries = GaugeMetricFamily(
            "mlxtrio_prefix_cache_entries", "KV snapshots held", labels=["model"]
        )
        for model, engine, lane in self._sources():
            index = engine.prefix_index
            cache_hits.add_metric([model], index.stats.hits)
            cache_misses.add_metric([model], index.stats.misses)
            cache_tokens.add_metric([model], index.stats.cached_tokens)
            cache_evictions.add_metric([model], index.stats.evictions)
            cache_bytes.add_metric([model], index.nbytes)
            cache_entries.add_metric([model], len(index))
            active.add_metric([model], engine.active_sequences)
            queued.add_metric([model], lane.waiting)
            generated.add_metric([model], engine.stats.generated_tokens)
            prompt.add_metric([model], engine.stats.prompt_tokens)
            steps.add_metric([model], engine.stats.steps)
            cancelled.add_metric([model], engine.stats.cancelled)
        yield from (active, queued, generated, prompt, steps, cancelled)
        yield from (
            cache_hits,
            cache_misses,
            cache_tokens,
            cache_evictions,
            cache_bytes,
            cache_entries,
        )


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
        self.registry.register(_LiveCollector(sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)
