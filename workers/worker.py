"""One tensor-parallel rank: device, process group, model shard, KV cache, and the step."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels import AttentionMetadata, select_backend
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.cache_engine import CacheEngine
from workers.layers import can_pack, pack_for_cpu
from workers.model_loader import load_model, read_model_spec
from workers.model_runner import ModelRunner
from workers.no_work import NoWorkRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# glibc's mallopt parameters. A step's activations (megabytes each) are above glibc's default mmap
# threshold, so every one came from fresh pages and its page faults cost as much as the elementwise
# op that filled it (16% of a 2048-token prefill step). Raising the threshold to its 32 MiB maximum
# and keeping freed memory keeps those buffers in the heap, reused step after step.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """Make glibc reuse freed activation buffers instead of returning them to the OS (no-op off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


@dataclass(slots=True)
class WorkerConfig:
    """What a rank needs to know; cluster's EngineConfig produces it."""

    model: str
    dtype: str = "float32"
    device: str = "auto"  # "cpu", "cuda" or "auto" (the GPU Ray assigned, else CPU)
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    tensor_parallel_size: int = 1
    kv_cache_bytes: int = 1 << 30  # CPU: the KV cache's size
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None: all cores this process may use
    no_work: bool = False  # benchmarking only: NoWorkRunner in place of the model (workers/no_work.py)


class Worker:
    """A rank's life: init_device → init_distributed → load_model → determine_num_blocks → init_cache → steps.

    The scheduler sizes the cache with the minimum of all ranks'
    ``determine_num_blocks``, so every rank's block ids mean the same slots.
    Only rank 0 (the driver) samples and returns tokens.
    """

    def __init__(self, config: WorkerConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device("cpu")
        self.model = None
        self.spec = None
        self.runner: ModelRunner | NoWorkRunner | None = None
        self.cache: CacheEngine | None = None

    def init_device(self) -> str:
        cfg = self.config
        want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        if want_cuda:
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
            # Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned this actor, so index 0 is ours.
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory()
        # Ray sets OMP_NUM_THREADS from the actor's num_cpus (often 1); choose on purpose instead.
        threads = cfg.num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        return str(self.device)

    def init_distributed(self, rank: int, world_size: int, master_addr: str, master_port: int,
                         backend: str | None = None, timeout_s: float = 300) -> None:
        self.rank = rank
        if world_size == 1:
            return
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))

    def load_model(self) -> None:
        cfg = self.config
        tp = cfg.tensor_parallel_size
        self.spec = read_model_spec(cfg.model, tp)
        if cfg.no_work:
            self.runner = NoWorkRunner(self.spec.vocab_size, is_driver=self.rank == 0)
            return
        backend = select_backend(cfg.attention_backend, self.device, cfg.block_size, DTYPES[cfg.dtype])
        self.model = load_model(cfg.model, dtype=DTYPES[cfg.dtype], device=self.device, attn_backend=backend,
                                tp_rank=self.rank, tp_size=tp)
        if can_pack(self.device, DTYPES[cfg.dtype]):
            pack_for_cpu(self.model)
        self.runner = ModelRunner(self.model, backend, cfg.block_size, cfg.max_model_len, self.spec.vocab_size,
                                  self.spec.eos_token_id, self.device, is_driver=self.rank == 0,
                                  max_rows=min(cfg.max_num_seqs, 256))

    def block_bytes(self) -> int:
        spec = self.spec
        return CacheEngine.block_bytes(spec.num_layers, self.config.block_size,
                                       spec.kv_heads_per_rank(self.config.tensor_parallel_size), spec.head_dim,
                                       DTYPES[self.config.dtype])

    def determine_num_blocks(self) -> int:
        """Blocks this rank can hold. CPU: kv_cache_bytes. GPU: what is left after a peak-memory profile."""
        if self.device.type != "cuda":
            return max(self.config.kv_cache_bytes // self.block_bytes(), 0)
        # blocks = (total * utilization - memory held before the profile - the profile's activation peak) // block.
        # Held is read before the profile (weights, CUDA context, memory outside torch): read after, it would also
        # count what the profile left in torch's caching allocator, which the peak already counts.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        activation_peak = self._profile_run()
        torch.cuda.empty_cache()  # hand the profile's blocks back, for the real cache
        budget = total * self.config.gpu_memory_utilization - (total - free) - activation_peak
        return max(int(budget // self.block_bytes()), 0)

    @torch.inference_mode()
    def _profile_run(self) -> int:
        """Peak bytes of a forward over the largest batch the scheduler may send, against a throwaway cache
        (not counted: the real cache takes its place)."""
        cfg, spec = self.config, self.spec
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        seq = min(cfg.max_model_len, num_tokens)
        lens = [seq] * (num_tokens // seq) + ([num_tokens % seq] if num_tokens % seq else [])
        blocks_per_seq = -(-seq // cfg.block_size)
        cache = CacheEngine(spec.num_layers, len(lens) * blocks_per_seq + 1, cfg.block_size,
                            spec.kv_heads_per_rank(cfg.tensor_parallel_size), spec.head_dim, DTYPES[cfg.dtype],
                            self.device)
        cache.bind(self.model.attention_layers)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        dev = self.device
        tables = torch.arange(1, len(lens) * blocks_per_seq + 1, dtype=torch.int32, device=dev).view(len(lens), -1)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        seq_ids = torch.cat([torch.full((n,), i, device=dev) for i, n in enumerate(lens)])
        slots = tables[seq_ids, positions // cfg.block_size].long() * cfg.block_size + positions % cfg.block_size
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
        md = AttentionMetadata.build(query_start_loc=cu, seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                                     block_tables=tables, slot_mapping=slots, max_query_len=seq, max_seq_len=seq,
                                     backend=self.runner.attn_backend)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=dev), positions, md)
        self.model.compute_logits(hidden[cu[1:].long() - 1])
        torch.cuda.synchronize()
        # The layers' views would keep the throwaway cache alive next to the real one.
        for layer in self.model.attention_layers:
            layer.kv_cache = torch.empty(0)
        return torch.cuda.max_memory_allocated() - start

    def init_cache(self, num_blocks: int) -> None:
        if self.model is None:  # the no-work runner reads no KV
            return
        cfg, spec = self.config, self.spec
        self.cache = CacheEngine(spec.num_layers, num_blocks, cfg.block_size,
                                 spec.kv_heads_per_rank(cfg.tensor_parallel_size), spec.head_dim,
                                 DTYPES[cfg.dtype], self.device)
        self.cache.bind(self.model.attention_layers)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute_model(scheduler_output)

    def check_health(self) -> bool:
        return self.runner is not None
