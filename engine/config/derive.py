"""The configs the engine's parts run with, derived from an EngineConfig: they carry no defaults or checks of
their own, so a setting is declared once (engine.py) and reaches the ranks and the scheduler from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.engine import EngineConfig
from scheduler import SchedulerConfig

if TYPE_CHECKING:  # the model stack and torch: seconds of import that `raylm serve`'s own process never needs
    from workers.model_spec import ModelSpec
    from workers.worker import WorkerConfig


def derive_worker_config(
    engine: EngineConfig,
    model_path: str,
    max_model_len: int,
    *,
    model_spec: ModelSpec,
    draft_spec: ModelSpec | None,
) -> WorkerConfig:
    """What each rank needs. ``model`` stays the id the user gave (a rank on another node resolves it into its
    own cache); ``model_path`` is this node's copy, used where the id names no hub model. ``model_spec`` and
    ``draft_spec`` are the engine's reading of the checkpoints (read_model_spec, check_draft)."""
    from workers.worker import WorkerConfig

    speculative = engine.speculative
    return WorkerConfig(
        model=model_path if engine.model is None else engine.model,
        revision=engine.revision,
        download_dir=engine.download_dir,
        dtype=engine.dtype,
        quantization=engine.quantization,
        device=engine.device,
        block_size=engine.block_size,
        max_model_len=max_model_len,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        pp_layer_partition=engine.layer_partition,
        enable_expert_parallel=engine.enable_expert_parallel,
        kv_cache_bytes=engine.kv_cache_bytes,
        swap_space_bytes=engine.swap_space_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        attention_backend=engine.attention_backend,
        kv_cache_dtype=engine.kv_cache_dtype,
        num_threads=engine.num_threads,
        enforce_eager=engine.enforce_eager,
        no_work=engine.no_work_model,
        tokenizer=engine.tokenizer,
        tokenizer_revision=engine.tokenizer_revision,
        seed=engine.seed,
        max_loras=engine.max_loras if engine.enable_lora else 0,
        max_lora_rank=engine.max_lora_rank,
        lora_modules=engine.lora_paths,
        draft_model=speculative.get("model"),
        num_speculative_tokens=speculative.get("num_speculative_tokens", 0),
        model_spec=model_spec,
        draft_spec=draft_spec,
    )


def steps_in_flight(engine: EngineConfig, on_gpu: bool) -> int:
    """How many steps the engine loop keeps in flight: P (at least two) with async scheduling, else one."""
    pp = engine.pipeline_parallel_size
    overlap = engine.async_scheduling if engine.async_scheduling is not None else on_gpu or pp > 1
    return max(2, pp) if overlap else 1


def derive_scheduler_config(
    engine: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    num_host_blocks: int = 0,
    swap_cost_per_block: float = 1.0,
    on_gpu: bool = False,
) -> SchedulerConfig:
    """The scheduler's config, once the ranks have sized the pools and the model's length is known: the checks
    that need those numbers are made here. ``on_gpu``: the ranks run on GPUs (async scheduling's default)."""
    if engine.preemption_mode == "swap" and num_host_blocks < 2:
        raise ValueError(
            f"preemption_mode='swap' needs a host tier, but swap_space={engine.swap_space:g} GiB holds "
            f"{num_host_blocks} KV blocks per rank (at least 2 are needed): raise swap_space"
        )
    if not engine.enable_chunked_prefill and engine.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={engine.max_num_batched_tokens} is invalid: without chunked "
            f"prefill it must be >= max_model_len={max_model_len}"
        )
    spec = engine.speculative
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=engine.block_size,
        max_model_len=max_model_len,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        long_prefill_token_threshold=engine.long_prefill_token_threshold,
        enable_prefix_caching=engine.enable_prefix_caching,
        enable_chunked_prefill=engine.enable_chunked_prefill,
        policy=engine.scheduling_policy,
        num_host_blocks=num_host_blocks,
        swap_cost_per_block=swap_cost_per_block,
        preemption_mode=engine.preemption_mode,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        steps_in_flight=steps_in_flight(engine, on_gpu),
        max_loras=engine.max_loras if engine.enable_lora else 0,
        num_speculative_tokens=spec.get("num_speculative_tokens", 0),
        speculative_method=spec.get("method", "ngram"),
        prompt_lookup_min=spec.get("prompt_lookup_min", 1),
        prompt_lookup_max=spec.get("prompt_lookup_max", 1),
        enable_kv_cache_events=engine.kv_events is not None,
    )
