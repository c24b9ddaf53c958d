"""vLLM's metrics for the whole deployment, through Ray's metrics export.

Each replica records its series with ``ray.util.metrics`` under a ``replica`` tag; Ray's metrics agent on
each node exports every process's series of that node (``ray_vllm_...`` on the node's metrics export port,
the way Ray Serve LLM exposes vLLM's metrics). So a Prometheus that scrapes Ray's endpoint on every node
(README: Ray's service-discovery file) sees every replica's series, each a counter owned by one replica
that never goes backwards, whichever node it scrapes first. The app's ``/metrics`` answers with the
answering node's export, renamed back to vLLM's names (``vllm:...``): on one node that is every replica.

Two properties of Ray's export, stated because dashboards see them: series reach the endpoint once per
Ray metrics report period (``RAY_metrics_report_interval_ms``), and a histogram's ``_sum`` is Ray's (it
adds each observation's bucket midpoint), so ``_sum / _count`` is approximate while buckets and counts
are exact.
"""

from __future__ import annotations

import asyncio
import urllib.request
from typing import TYPE_CHECKING

import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.util.metrics import Counter, Gauge, Histogram

from scheduler import SchedulerStats

if TYPE_CHECKING:
    from engine.client import EngineClient
    from engine.config import EngineConfig

ENGINE_STATS_PERIOD_S = 1.0

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets, so that dashboards built for vLLM read these histograms the same way.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TPOT_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_TIME_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
# Ray's exporter prefixes every user metric with "ray_" and forbids ':'; these map its names back to vLLM's.
RAY_PREFIXES = {"ray_vllm_": "vllm:", "ray_raylm_": "raylm:"}
# Labels Ray adds to every series; the replica label already tells replicas apart.
RAY_LABELS = {
    "Component",
    "NodeAddress",
    "SessionName",
    "Version",
    "WorkerId",
    "JobId",
    "otel_scope_name",
    "otel_scope_schema_url",
    "otel_scope_version",
}
TAGS = ("model_name", "replica")


def _counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
    return Counter(name, doc, tag_keys=TAGS + extra)


def _histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
    return Histogram(name, doc, boundaries=buckets, tag_keys=TAGS)


def replica_metrics(model_name: str, engine: EngineClient, cfg: EngineConfig) -> ServeMetrics:
    """This Serve replica's series, labelled with its id and its engine's cache configuration."""
    return ServeMetrics(
        model_name,
        serve.get_replica_context().replica_id.unique_id,
        {
            "block_size": str(cfg.block_size),
            "num_gpu_blocks": str(engine.num_blocks),
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "cache_dtype": str(cfg.dtype),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
        },
    )


async def publish_engine_stats(metrics: ServeMetrics, engine: EngineClient) -> None:
    """The engine's gauges and totals into Ray's metrics, each period (a gauge not set for two of Ray's report
    periods ages out of the export)."""
    while True:
        try:
            metrics.record_engine(await engine.get_stats())
        except Exception:  # a dead engine fails check_health, which restarts this replica
            pass
        await asyncio.sleep(ENGINE_STATS_PERIOD_S)


class ServeMetrics:
    """One replica's series: the requests it served, and its engine's gauges and totals.

    The engine's totals are cumulative in the scheduler; ``record_engine`` adds
    only what they grew by since the last call, so the exported counter equals
    the scheduler's and cannot double count.
    """

    def __init__(self, model_name: str, replica: str, cache_config: dict[str, str]) -> None:
        tags = {"model_name": model_name, "replica": replica}
        self.prompt_tokens = _counter("vllm_prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = _counter("vllm_generation_tokens", "Tokens generated.")
        self.success = _counter(
            "vllm_request_success", "Finished requests (samples), by finish reason.", ("finished_reason",)
        )
        self.ttft = _histogram("vllm_time_to_first_token_seconds", "Time to the first generated token.", TTFT_BUCKETS)
        self.tpot = _histogram(
            "vllm_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        )
        self.itl = _histogram(
            "vllm_inter_token_latency_seconds", "Time between two deltas of one request, per token.", TPOT_BUCKETS
        )
        self.e2e = _histogram("vllm_e2e_request_latency_seconds", "Arrival to last token.", REQUEST_TIME_BUCKETS)
        self.queue = _histogram(
            "vllm_request_queue_time_seconds",
            "Time waiting in the scheduler before the request first ran.",
            REQUEST_TIME_BUCKETS,
        )
        self.prefill = _histogram(
            "vllm_request_prefill_time_seconds", "First scheduled to first token.", REQUEST_TIME_BUCKETS
        )
        self.decode = _histogram("vllm_request_decode_time_seconds", "First token to last token.", REQUEST_TIME_BUCKETS)
        self.prompt_hist = _histogram("vllm_request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.rejected = _counter(
            "raylm_requests_rejected", "Requests refused because the replica's queue was full (429)."
        )
        self.generation_hist = _histogram(
            "vllm_request_generation_tokens", "Generated tokens per sample.", TOKEN_BUCKETS
        )
        self.engine_gauges = [
            Gauge(n, d, tag_keys=TAGS)
            for n, d in (
                ("vllm_num_requests_running", "Requests in the running batch."),
                ("vllm_num_requests_waiting", "Requests waiting to be scheduled."),
                ("vllm_kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use."),
                # the host tier: vLLM v0's names
                ("vllm_num_requests_swapped", "Requests preempted by swap, their KV in host memory."),
                ("vllm_cpu_cache_usage_perc", "Host-tier KV-cache usage: 1 means every block is in use."),
            )
        ]
        self.engine_counters = [
            _counter(n, d)
            for n, d in (
                ("vllm_prefix_cache_queries", "Prefix-cache queries (tokens)."),
                ("vllm_prefix_cache_hits", "Prefix-cache hits (tokens)."),
                ("vllm_num_preemptions", "Preemptions (recompute or swap) since start."),
                ("raylm_engine_steps", "Engine steps (schedule, execute, update) since start."),
                # the host tier: the prefix-cache counter's name with v0's cpu_, raylm's own for block copies
                ("vllm_cpu_prefix_cache_hits", "Prefix-cache hits (tokens) served from the host tier."),
                ("raylm_kv_blocks_swapped_out", "KV blocks copied from the device to the host tier."),
                ("raylm_kv_blocks_swapped_in", "KV blocks copied from the host tier to the device."),
                ("vllm_spec_decode_num_drafts", "Speculative decoding: proposals verified (one per request and step)."),
                ("vllm_spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens."),
                ("vllm_spec_decode_num_accepted_tokens", "Speculative decoding: accepted proposed tokens."),
            )
        ]
        self.accepted_per_pos = _counter(
            "vllm_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted proposed tokens, by position in their proposal.",
            ("position",),
        )
        self.accepted_per_pos_totals: list[int] = []
        self.info = info = Gauge(
            "vllm_cache_config_info",
            "The KV cache's configuration, in labels (value 1).",
            tag_keys=TAGS + tuple(cache_config),
        )
        for metric in [
            self.prompt_tokens,
            self.generation_tokens,
            self.success,
            self.ttft,
            self.tpot,
            self.itl,
            self.e2e,
            self.queue,
            self.prefill,
            self.decode,
            self.prompt_hist,
            self.generation_hist,
            self.rejected,
            info,
            *self.engine_gauges,
            *self.engine_counters,
            self.accepted_per_pos,
        ]:
            metric.set_default_tags(tags)
        self.cache_config = cache_config
        self.engine_totals = [0] * len(self.engine_counters)

    def finished(
        self,
        reason: str,
        num_tokens: int,
        arrival: float,
        first_token: float | None,
        end: float,
        queued_s: float | None,
    ) -> None:
        """Record one finished sample: its finish reason, and its latencies (times from time.monotonic();
        ``queued_s`` the scheduler's wait before it first ran, None if it never ran)."""
        self.success.inc(tags={"finished_reason": reason})
        self.e2e.observe(end - arrival)
        self.generation_hist.observe(num_tokens)
        if queued_s is not None:
            self.queue.observe(queued_s)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            self.decode.observe(end - first_token)
            if queued_s is not None:
                self.prefill.observe(max(first_token - arrival - queued_s, 0.0))
            if num_tokens > 1:
                self.tpot.observe((end - first_token) / (num_tokens - 1))

    def embedded(self, num_prompt_tokens: int, arrival: float, end: float, queued_s: float | None) -> None:
        """Record one finished embedding request (one input of /v1/embeddings): its prompt tokens and its
        latencies; it generates nothing, so it has no token latencies and finishes with "stop"."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_hist.observe(num_prompt_tokens)
        self.success.inc(tags={"finished_reason": "stop"})
        self.e2e.observe(end - arrival)
        if queued_s is not None:
            self.queue.observe(queued_s)

    def record_engine(self, s: SchedulerStats) -> None:
        """Called each period: Ray drops a gauge from its export when it was not set for two report periods."""
        self.info.set(1, tags=self.cache_config)
        gauges = (s.num_running, s.num_waiting, s.kv_cache_usage, s.num_swapped, s.host_cache_usage)
        for gauge, value in zip(self.engine_gauges, gauges, strict=True):
            gauge.set(value)
        totals = (
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.num_preemptions,
            s.num_steps,
            s.host_prefix_cache_hits,
            s.num_blocks_swapped_out,
            s.num_blocks_swapped_in,
            s.spec_decode_num_drafts,
            s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens,
        )
        for i, (counter, total) in enumerate(zip(self.engine_counters, totals, strict=True)):
            if total > self.engine_totals[i]:
                counter.inc(total - self.engine_totals[i])
                self.engine_totals[i] = total
        per_pos = s.spec_decode_num_accepted_tokens_per_pos or []
        self.accepted_per_pos_totals += [0] * (len(per_pos) - len(self.accepted_per_pos_totals))
        for pos, total in enumerate(per_pos):
            if total > self.accepted_per_pos_totals[pos]:
                self.accepted_per_pos.inc(total - self.accepted_per_pos_totals[pos], tags={"position": str(pos)})
                self.accepted_per_pos_totals[pos] = total


def node_metrics_port() -> int:
    """This node's Ray metrics export port."""
    node_id = ray.get_runtime_context().get_node_id()
    return next(n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == node_id)


def render_node_metrics(port: int) -> str:
    """The vLLM and raylm series Ray exports on this node, under vLLM's names, Ray's own labels dropped."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return vllm_series(r.read().decode())


# Lines of the export that belong to our series: their samples, and the HELP and TYPE comments naming them.
OUR_LINES = tuple(f"{comment}{p}" for p in RAY_PREFIXES for comment in ("", "# HELP ", "# TYPE "))


def vllm_series(export: str) -> str:
    """Ray's node export ``export`` reduced to its vLLM and raylm series, renamed to vLLM's names. Ours are a few
    dozen of its thousands of lines (Ray's own gRPC, task and Serve series): they are picked out before the
    Prometheus parser runs, which costs a fifth of a second of the replica's CPU per scrape on the whole export."""
    ours = "\n".join(line for line in export.splitlines() if line.startswith(OUR_LINES))
    lines = []
    for family in text_string_to_metric_families(ours):
        prefix = next(p for p in RAY_PREFIXES if family.name.startswith(p))
        name = RAY_PREFIXES[prefix] + family.name[len(prefix) :]
        lines += [f"# HELP {name} {family.documentation}", f"# TYPE {name} {family.type}"]
        for s in family.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()) if k not in RAY_LABELS)
            lines.append(f"{RAY_PREFIXES[prefix]}{s.name[len(prefix) :]}{{{labels}}} {s.value!r}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
