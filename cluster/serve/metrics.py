"""Prometheus metrics with vLLM's names (``vllm:...``, labelled by model_name), one private registry
per Serve replica, so that they never mix with Serve's own metrics or another replica's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler import SchedulerStats

# The *_created series double every counter and histogram and nothing here reads them (vLLM drops them too).
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets, so that dashboards built for vLLM read these histograms the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """The engine's own gauges and totals, read from the scheduler's stats at scrape time.

    The scheduler already keeps these counts (cumulative for the counters), so
    exposing its numbers as they are cannot double count or drift.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: SchedulerStats | None = None

    def collect(self) -> list[Metric]:
        s = self.stats
        if s is None:
            return []
        families = [
            GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch.",
                              labels=["model_name"]),
            GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                              labels=["model_name"]),
            GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.",
                              labels=["model_name"]),
            CounterMetricFamily("vllm:prefix_cache_queries", "Prefix-cache queries.", labels=["model_name"]),
            CounterMetricFamily("vllm:prefix_cache_hits", "Prefix-cache hits.", labels=["model_name"]),
            CounterMetricFamily("vllm:num_preemptions", "Preemptions (recompute) since start.",
                                labels=["model_name"]),
            CounterMetricFamily("raylm:engine_steps", "Engine steps (schedule, execute, update) since start.",
                                labels=["model_name"]),
        ]
        values = (s.num_running, s.num_waiting, s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits,
                  s.num_preemptions, s.num_steps)
        for family, value in zip(families, values):
            family.add_metric([self.model_name], value)
        return families


class ServeMetrics:
    """One replica's metrics: engine stats plus the requests this replica served.

    Per-request series (tokens, finished requests, latencies) count this
    replica's requests only; a scrape through the Serve proxy reaches one
    replica, so a Prometheus setup with several replicas scrapes each.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        r, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label,
                                         registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests (samples), by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first generated token.", label,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", label,
                              buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", label,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.rejected = Counter("raylm:requests_rejected", "Requests refused because the replica's queue was full "
                                "(429).", label, registry=r).labels(model_name)
        self.model_name = model_name

    def finished(self, reason: str, num_tokens: int, arrival: float, first_token: float | None,
                 end: float) -> None:
        """Record one finished sample: its finish reason, and its latencies (times from time.monotonic())."""
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((end - first_token) / (num_tokens - 1))

    def render(self, stats: SchedulerStats) -> bytes:
        """The text exposition, with the engine stats just fetched (no await between setting and reading)."""
        self.engine.stats = stats
        return generate_latest(self.registry)
