"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own.

Request outcomes and latencies are counted by the server as requests end; the engine's running
totals (tokens, forwards, drafted and accepted tokens, hence tau and acceptance) and the queue
lengths are read when scraped, so they cost nothing per step; decode step times come from the
engine's step observers.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, async_llm, traffic):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("multispec_requests", "API requests that ran, by endpoint and outcome (ok, failed, "
                                "aborted: the client left)", ["endpoint", "outcome"], registry=registry)
        self.rejected = Counter("multispec_rejected_requests", "requests refused before they ran, by HTTP status",
                                ["status"], registry=registry)
        self.first_token = Histogram("multispec_time_to_first_token_seconds", "from arrival to the first token",
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("multispec_e2e_request_latency_seconds", "from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.step_time = Histogram("multispec_step_seconds", "wall time of a decode step (draft, forward, verify, "
                                   "commit)", buckets=STEP_BUCKETS, registry=registry)
        registry.register(_EngineCollector(async_llm, traffic))
        async_llm.engine.step_observers.append(self._observe_step)

    def _observe_step(self, report) -> None:
        self.step_time.observe(report.time_draft + report.time_forward + report.time_verify + report.time_commit)

    def finished(self, endpoint: str, outcome: str, start: float, first_token: float | None) -> None:
        self.requests.labels(endpoint, outcome).inc()
        if outcome == "ok":
            self.latency.observe(time.monotonic() - start)
            if first_token is not None:
                self.first_token.observe(first_token - start)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's counters and the queues, read at scrape time."""

    def __init__(self, async_llm, traffic):
        self.async_llm = async_llm
        self.traffic = traffic

    def collect(self):
        engine = self.async_llm.engine
        stats = engine.stats
        counters = {
            "prompt_tokens": ("prompt tokens prefilled (computed or reused)", stats.prompt_tokens),
            "prefix_cache_hits": ("prompt tokens whose keys and values were reused from earlier prompts",
                                  stats.cached_prompt_tokens),
            "generation_tokens": ("tokens generated", stats.generated_tokens),
            "decode_forwards": ("target forwards of decode steps", stats.decode_forwards),
            "drafted_tokens": ("draft tokens verified", stats.drafted_tokens),
            "accepted_tokens": ("draft tokens accepted", stats.accepted_tokens),
        }
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(f"multispec_{name}", help_text, value=value)
        gauges = {
            "tau": ("tokens a sample gains per target forward, since the start", stats.tau),
            "draft_acceptance_rate": ("accepted / drafted tokens, since the start", stats.acceptance_rate),
            "requests_waiting": ("requests (one per prompt) waiting for their first token", self.traffic.waiting),
            "requests_running": ("requests (one per prompt) generating", self.traffic.running),
            "samples_running": ("samples in the engine's batch", len(engine.scheduler.slots)),
            "engine_healthy": ("1 while the engine loop runs", float(self.async_llm.healthy)),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(f"multispec_{name}", help_text, value=value)
