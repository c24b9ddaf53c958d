"""The in-process engine: one Scheduler and one Worker in this process, no Ray (tp=1 debugging)."""

from __future__ import annotations

import dataclasses
import time

from cluster.config import EngineConfig
from scheduler import RequestOutput, SamplingParams, Scheduler, SchedulerStats
from workers.model_loader import ModelSpec, read_model_spec
from workers.structured_output import compile_grammar
from workers.worker import Worker


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return min(spec.max_position_embeddings, 8192)
    if config.max_model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} is over the model's "
                         f"max_position_embeddings={spec.max_position_embeddings}")
    return config.max_model_len


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Reject a prompt before it reaches the batch, so one bad request never fails the others."""
    if not prompt_token_ids:
        raise ValueError("prompt is empty: it must have at least one token")
    for t in prompt_token_ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, but max_model_len={max_model_len} "
                         f"leaves no room to generate")


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """Reject what SamplingParams cannot check alone: token ids past the vocabulary, a constraint that does not
    compile. Here, before scheduling, because a worker meeting them would fail the whole step."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        if bad := next((t for t in ids if t >= vocab_size), None):
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.structured_outputs is not None:
        compile_grammar(params.structured_outputs)


def with_eos_stop_token_ids(params: SamplingParams, spec: ModelSpec) -> SamplingParams:
    """``params`` stopping on every EOS id of the model: models with several (generation_config) stop on any of
    them, as transformers does."""
    extra = [t for t in spec.eos_token_ids if t != spec.eos_token_id and t not in params.stop_token_ids]
    if not extra or params.ignore_eos:
        return params
    return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)


class InProcessEngine:
    """Scheduler and a single worker in one process, stepped by the caller.

    The same step the Ray engine runs (schedule → execute → update), without
    actors: what tests and `--executor inprocess` use to debug the model path.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: the in-process engine "
                             f"runs one rank; use the Ray engine for tensor parallelism")
        self.config = config
        self.model_path = config.resolved_model()
        self.spec = read_model_spec(self.model_path)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        self.worker = Worker(config.worker_config(self.model_path, self.max_model_len))
        self.device = self.worker.init_device()
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        if num_blocks < 2:
            raise ValueError(f"the KV cache holds {num_blocks} blocks of {self.worker.block_bytes()} bytes; "
                             f"raise kv_cache_bytes (now {config.kv_cache_bytes}) or gpu_memory_utilization")
        num_host_blocks = self.worker.determine_num_host_blocks()
        self.worker.init_cache(num_blocks, num_host_blocks)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(config.scheduler_config(num_blocks, self.max_model_len, num_host_blocks,
                                                           self.worker.swap_cost_per_block()),
                                   eos_token_id=self.spec.eos_token_id)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> list[RequestOutput]:
        check_prompt(prompt_token_ids, self.spec.vocab_size, self.max_model_len)
        check_params(params, self.spec.vocab_size)
        return self.scheduler.add_request(request_id, prompt_token_ids, with_eos_stop_token_ids(params, self.spec),
                                          priority=priority, arrival_time=time.monotonic(), cache_salt=cache_salt)

    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        try:
            out = self.worker.execute_model(so)
        except Exception as e:  # the step's requests cannot go on; everyone hears why
            return self.scheduler.fail_all(f"engine step failed: {type(e).__name__}: {e}")
        return self.scheduler.update_from_output(so, out)

    def abort(self, request_id: str) -> list[RequestOutput]:
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Drop the model and KV cache now rather than at garbage collection (a process building several
        engines, like the benchmarks, would otherwise hold two at once)."""
        self.worker = None
