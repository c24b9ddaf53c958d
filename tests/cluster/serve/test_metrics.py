"""The engine's stats as Prometheus series: the host tier's gauges and counters carry the scheduler's numbers."""

from prometheus_client.parser import text_string_to_metric_families

from cluster.serve.metrics import ServeMetrics
from scheduler import SchedulerStats


def test_host_tier_series_carry_the_schedulers_stats():
    stats = SchedulerStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, prefix_cache_queries=100,
                           prefix_cache_hits=64, num_preemptions=2, num_steps=9, num_scheduled_tokens=1,
                           num_admitted=0, num_swapped=3, host_cache_usage=0.25, host_prefix_cache_hits=48,
                           num_blocks_swapped_out=7, num_blocks_swapped_in=5)
    text = ServeMetrics("m").render(stats).decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.labels == {"model_name": "m"}}
    assert got["vllm:num_requests_swapped"] == 3 and got["vllm:cpu_cache_usage_perc"] == 0.25
    assert got["vllm:cpu_prefix_cache_hits_total"] == 48
    assert got["raylm:kv_blocks_swapped_out_total"] == 7 and got["raylm:kv_blocks_swapped_in_total"] == 5
