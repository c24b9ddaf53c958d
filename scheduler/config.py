"""The scheduler's limits (SchedulerConfig, filled from cluster's EngineConfig) and what it reports (SchedulerStats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one engine's scheduler. ``num_blocks`` includes the null block 0. cluster's EngineConfig declares
    and checks every user-facing value and fills in the rest (the pools' sizes, measured by the ranks), so nothing
    here has a default or a check of its own."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # 0: a prefill chunk is limited only by the budget
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    policy: str  # "fcfs", or "priority": lower value runs first, ties by arrival
    num_host_blocks: int  # the host tier, including its unused block 0; 0: no host tier
    preemption_mode: str  # "recompute", "swap" (to the host tier) or "auto" (see Scheduler._swap_pays)
    # The time to copy one block to the host tier and back, in units of the time to compute one token.
    swap_cost_per_block: float
    # Pipeline stages. Above 1, up to that many steps are in flight, and a request whose sampled token is still
    # in flight is not scheduled again (Scheduler's invariants say why); the scheduler sends each request's
    # samples to the ranks that do not sample (CachedRequestData.new_token_ids).
    pipeline_parallel_size: int
    # The most steps the engine loop keeps in flight: max(2, P) with async scheduling, 1 in the serial loop. A
    # pipelined step takes at most ceil(live requests / min(P, this)) requests (Scheduler's invariants say why).
    steps_in_flight: int
    max_loras: int  # LoRA adapters one step may use (the ranks' resident slots); 0: LoRA off
    # Speculative decoding: up to this many proposed tokens per request and step (0: off). speculative_method
    # "ngram": from matches of the request's last prompt_lookup_max..prompt_lookup_min tokens (scheduler/ngram.py);
    # "draft_model": what a draft model on the sampling rank proposed (ModelRunnerOutput.draft_token_ids).
    num_speculative_tokens: int
    speculative_method: str
    prompt_lookup_min: int
    prompt_lookup_max: int
    # KV-cache events (scheduler/kv_events.py): what entered and left the prefix cache, taken once per step.
    enable_kv_cache_events: bool


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_scheduled_tokens: int  # in the last step
    num_admitted: int  # requests that entered the running batch in the last step
    num_swapped: int = 0  # requests preempted by swap, their KV in the host tier
    host_cache_usage: float = 0.0
    host_prefix_cache_hits: int = 0  # tokens, of prefix_cache_hits, that came from the host tier
    num_blocks_swapped_out: int = 0  # device -> host copies since start (preemption and evicted hashed blocks)
    num_blocks_swapped_in: int = 0  # host -> device copies since start
    # Speculative decoding, since start: steps that verified proposals (one per request), proposed tokens, accepted
    # ones, and accepted ones by position in their proposal (vLLM's vllm:spec_decode_* counters)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] | None = None
    # Prefill/decode disaggregation, since start, filled by the transport that fetches the KV (the scheduler never
    # sees it): requests whose KV reached every rank, the bytes the ranks fetched, and the seconds that took
    num_kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    # The weights the engine serves: "default" (the checkpoint's) until an update names a version; filled by the
    # engine core, which runs the updates (the scheduler never sees them)
    weight_version: str = "default"
