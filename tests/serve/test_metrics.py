"""The engine's stats as Prometheus series through Ray's metrics export: the host tier's gauges and counters (and
speculative decoding's) carry the scheduler's numbers, and the counters follow the scheduler's totals without double counting."""

import time
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler import SchedulerStats
from serve.metrics import ServeMetrics, node_metrics_port, render_node_metrics, vllm_series

WAIT_S = 30.0  # Ray exports once per report period (1 s in the test session)


def stats(**host_tier: float) -> SchedulerStats:
    return SchedulerStats(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.5,
        prefix_cache_queries=100,
        prefix_cache_hits=64,
        num_preemptions=2,
        num_steps=9,
        num_scheduled_tokens=1,
        num_admitted=0,
        **host_tier,
    )


def exported(replica: str, report, done) -> dict[str, float]:
    """This replica's series on the node's export, under vLLM's names, once done(them) holds. ``report()`` runs
    before each read, as the replica reports once per period: Ray drops a gauge not set for two report periods,
    and on a loaded machine the first export can come later than that."""
    port = node_metrics_port()
    deadline = time.monotonic() + WAIT_S
    while True:
        report()
        text = render_node_metrics(port)
        got = {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.labels.get("replica") == replica
        }
        if done(got):
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"the export did not reach the expected values within {WAIT_S} s: {got}")
        time.sleep(0.2)


def assert_exported(metrics: ServeMetrics, replica: str, s: SchedulerStats, want: dict[str, float]) -> None:
    """Report ``s`` until every series of ``want`` is exported with its value (the wait fails naming what was
    there instead). Reporting the same totals again adds nothing to the counters."""
    exported(
        replica, lambda: metrics.record_engine(s), lambda m: all(m.get(name) == value for name, value in want.items())
    )


def test_host_tier_series_carry_the_schedulers_stats(ray_session):
    replica = f"test-{uuid.uuid4().hex[:8]}"
    metrics = ServeMetrics("m", replica, {"block_size": "16"})
    first = stats(
        num_swapped=3,
        host_cache_usage=0.25,
        host_prefix_cache_hits=48,
        num_blocks_swapped_out=7,
        num_blocks_swapped_in=5,
        spec_decode_num_drafts=3,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=4,
        spec_decode_num_accepted_tokens_per_pos=[4],
    )
    # Each series reaches the export on its own flush: wait for all of them, so a late one is not a failure.
    assert_exported(
        metrics,
        replica,
        first,
        {
            "vllm:num_requests_swapped": 3,
            "vllm:cpu_cache_usage_perc": 0.25,
            "vllm:cpu_prefix_cache_hits_total": 48,
            "raylm:kv_blocks_swapped_out_total": 7,
            "raylm:kv_blocks_swapped_in_total": 5,
            "vllm:spec_decode_num_drafts_total": 3,
            "vllm:spec_decode_num_draft_tokens_total": 12,
            "vllm:spec_decode_num_accepted_tokens_total": 4,
            "vllm:spec_decode_num_accepted_tokens_per_pos_total": 4,
        },
    )
    # Totals are cumulative in the scheduler: a second report adds only the growth.
    second = stats(
        num_swapped=0,
        host_cache_usage=0.0,
        host_prefix_cache_hits=50,
        num_blocks_swapped_out=7,
        num_blocks_swapped_in=9,
    )
    assert_exported(
        metrics,
        replica,
        second,
        {
            "vllm:cpu_prefix_cache_hits_total": 50,
            "raylm:kv_blocks_swapped_out_total": 7,
            "raylm:kv_blocks_swapped_in_total": 9,
            "vllm:num_requests_swapped": 0,
        },
    )


RAY_EXPORT = """\
# HELP ray_tasks Current number of tasks currently in a particular state.
# TYPE ray_tasks gauge
ray_tasks{Component="core_worker",SessionName="s",State="RUNNING"} 3.0
# HELP ray_vllm_time_to_first_token_seconds Time to first token.
# TYPE ray_vllm_time_to_first_token_seconds histogram
ray_vllm_time_to_first_token_seconds_bucket{SessionName="s",le="0.1",model_name="m",replica="r1"} 2.0
ray_vllm_time_to_first_token_seconds_bucket{SessionName="s",le="+Inf",model_name="m",replica="r1"} 3.0
ray_vllm_time_to_first_token_seconds_count{SessionName="s",model_name="m",replica="r1"} 3.0
ray_vllm_time_to_first_token_seconds_sum{SessionName="s",model_name="m",replica="r1"} 0.4
# HELP ray_grpc_server_req_new_total gRPC requests (the vllm_ in a label is not a name of ours).
# TYPE ray_grpc_server_req_new_total counter
ray_grpc_server_req_new_total{Method="ray_vllm_x",SessionName="s"} 7.0
# HELP ray_raylm_engine_steps_total Engine steps.
# TYPE ray_raylm_engine_steps_total counter
ray_raylm_engine_steps_total{NodeAddress="10.0.0.1",model_name="m",replica="r1"} 9.0
"""


def test_the_render_keeps_only_our_series_under_vllms_names_without_rays_labels():
    assert vllm_series(RAY_EXPORT) == (
        "# HELP vllm:time_to_first_token_seconds Time to first token.\n"
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m",replica="r1"} 2.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m",replica="r1"} 3.0\n'
        'vllm:time_to_first_token_seconds_count{model_name="m",replica="r1"} 3.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m",replica="r1"} 0.4\n'
        "# HELP raylm:engine_steps Engine steps.\n"
        "# TYPE raylm:engine_steps counter\n"
        'raylm:engine_steps_total{model_name="m",replica="r1"} 9.0\n'
    )
