"""Scheduler configs for tests that drive the scheduler alone: SchedulerConfig has no defaults (EngineConfig fills
it in an engine), so these are the tests' own, with the engine's values where a test does not care."""

from scheduler import SchedulerConfig

TEST_DEFAULTS = dict(
    block_size=16,
    max_model_len=2048,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    long_prefill_token_threshold=0,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    policy="fcfs",
    num_host_blocks=0,
    preemption_mode="auto",
    swap_cost_per_block=1.0,
    pipeline_parallel_size=1,
    steps_in_flight=2,
    max_loras=0,
    num_speculative_tokens=0,
    speculative_method="ngram",
    prompt_lookup_min=1,
    prompt_lookup_max=1,
    enable_kv_cache_events=False,
)


def scheduler_config(num_blocks: int, **overrides) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=num_blocks, **{**TEST_DEFAULTS, **overrides})
