"""The server's Prometheus metrics (`/metrics`), with prometheus-client: requests by outcome, tokens,
latency histograms, and the engine's live state read when scraped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class EngineCollector:
    """The engine's state at scrape time: running and waiting requests, KV blocks in use, prefix-cache
    hit rate, preemptions (`Engine.stats`; nothing while no engine is built)."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self._stats = stats

    def collect(self) -> Any:
        stats = self._stats() or {}
        for name, key, text in (
            ("hfaccel_requests_running", "running", "Requests in the running batch"),
            ("hfaccel_requests_waiting", "waiting", "Requests waiting to be scheduled"),
            ("hfaccel_kv_blocks_used", "kv_blocks_used", "KV-cache blocks in use"),
            ("hfaccel_kv_blocks", "kv_blocks", "KV-cache blocks in all"),
            (
                "hfaccel_prefix_cache_hit_rate",
                "prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache",
            ),
            ("hfaccel_preemptions", "preemptions", "Requests preempted so far (recomputed later)"),
        ):
            yield GaugeMetricFamily(name, text, value=float(stats.get(key) or 0))


class ServerMetrics:
    """One registry per server (two servers in a process never share counters)."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "hfaccel_requests",
            "Requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "hfaccel_prompt_tokens", "Prompt tokens of served requests", registry=self.registry
        )
        self.generated_tokens = Counter(
            "hfaccel_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.ttft = Histogram(
            "hfaccel_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "hfaccel_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "hfaccel_e2e_request_latency_seconds",
            "Request latency",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(stats))

    def finished(
        self, endpoint: str, outcome: str, prompt: int, generated: int, times: dict[str, Any]
    ) -> None:
        """Count one request (`times`: ``ttft_s``, ``tpot_s``, ``e2e_s`` where known)."""
        self.requests.labels(endpoint, outcome).inc()
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)
        for histogram, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"), (self.e2e, "e2e_s")):
            value = times.get(key)
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
