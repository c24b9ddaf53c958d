"""One tensor-parallel rank: device, process group, model shard, KV cache, and the step."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from kernels import AttentionBackend, AttentionMetadata, select_backend
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers import weight_update
from workers.cache_engine import CacheEngine, check_swap_space
from workers.draft import DraftModel
from workers.hub import resolve_model
from workers.layers import can_pack, pack_for_cpu
from workers.lora import LoraManager
from workers.memory import (
    MemoryProfile,
    MemorySnapshot,
    graph_pool_bytes,
    keep_freed_memory,
    kv_cache_budget,
    profile_peak,
    return_freed_memory,
)
from workers.model_loader import _checkpoint_names, load_kv_scales, load_model, load_weights
from workers.model_runner import ModelRunner
from workers.model_spec import ModelSpec
from workers.no_work import NoWorkRunner
from workers.parallel import PipelineStage, StageLink, partition_layers, pipeline_stage, set_parallel
from workers.quantization.conversion import fp8_products_where_supported
from workers.runner_inputs import PendingStep, graph_batch_sizes
from workers.sleep import SleepState, allocate, check_tags, drop_packed, free, offload, restore
from workers.structured_output import GrammarBitmasks
from workers.weight_group import WeightGroup, default_backend, join, leave, receive

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype's names other than "auto" (the model's dtype): both are vLLM's spellings of one format.
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# Round figures for the preemption cost model (swap_cost_per_block): dense matmul rate a forward reaches, and
# host <-> KV-cache copy bandwidth (a memcpy on CPU, pinned PCIe on CUDA).
FLOPS_PER_S = {"cpu": 1e11, "cuda": 1e14}
HOST_LINK_BYTES_PER_S = {"cpu": 1e10, "cuda": 2e10}


def wants_cuda(device: str) -> bool:
    """Whether a configured device ("cpu", "cuda" or "auto": CUDA when torch sees a GPU) means CUDA."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def resolve_dtype(
    name: str, checkpoint_dtype: torch.dtype | None, device: torch.device, bf16_supported: bool = True
) -> torch.dtype:
    """The dtype a rank runs in. A name other than "auto" is taken as given.

    "auto" is float32 on CPU (these CPUs have no fast half-precision matmul, and fp32 keeps greedy
    outputs equal to transformers'). On CUDA it is the checkpoint's own half dtype; an fp32 (or
    unrecorded) checkpoint runs in bfloat16, or float16 where the GPU lacks bf16, as vLLM does: fp32
    would double the weights' memory, run cuBLAS at a fraction of the half rate, and rule out flash-attn.
    """
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    if checkpoint_dtype == torch.float16 or (checkpoint_dtype == torch.bfloat16 and bf16_supported):
        return checkpoint_dtype
    return torch.bfloat16 if bf16_supported else torch.float16


def cuda_index(gpu_ids: Sequence[int | str], visible_devices: str | None) -> int:
    """The torch index of the GPU Ray assigned this rank (its first, for an actor holding several).

    Ray names a GPU by its node-wide id; torch numbers the GPUs that CUDA_VISIBLE_DEVICES lists.
    By default Ray masks each actor to its own GPUs, so the id is at index 0. With
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES Ray leaves the variable alone: unset, every GPU
    is visible and the id is the index; set by the operator, the id's position in it is. Taking
    index 0 regardless put every rank of a node on the same GPU. No ids (no Ray): the first GPU.
    """
    if not gpu_ids:
        return 0
    gpu = str(gpu_ids[0])
    if visible_devices is None:
        return int(gpu)
    listed = [d.strip() for d in visible_devices.split(",")]
    if gpu not in listed:
        raise ValueError(f"Ray assigned GPU {gpu}, but CUDA_VISIBLE_DEVICES={visible_devices!r} does not list it")
    return listed.index(gpu)


@dataclass(slots=True)
class WorkerConfig:
    """What a rank needs to know. cluster's EngineConfig declares, checks and fills in every field (so none has a
    default here); `model` and `tokenizer` may be hub ids, which each rank resolves into its own node's cache."""

    model: str
    revision: str | None
    download_dir: str | None
    tokenizer: str | None  # for structured outputs' token masks (rank 0); None: the model's directory
    tokenizer_revision: str | None
    dtype: str  # a DTYPES name, or "auto" (see resolve_dtype)
    quantization: str | None  # --quantization: a plain checkpoint's weights quantized at load by this method
    device: str  # "cpu", "cuda" or "auto" (the GPU Ray assigned, else CPU)
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pp_layer_partition: list[int] | None  # layers per stage; None: balanced (workers.parallel.partition_layers)
    enable_expert_parallel: bool  # MoE: whole experts per rank rather than a slice of each
    kv_cache_bytes: int  # CPU: the KV cache's size
    swap_space_bytes: int  # the host tier's size on this rank; 0: none
    gpu_memory_utilization: float
    attention_backend: str
    kv_cache_dtype: str  # "auto" (the model's dtype) or a KV_DTYPES name
    num_threads: int | None  # torch intra-op threads; None: all cores this process may use
    no_work: bool  # benchmarking only: NoWorkRunner in place of the model (workers/no_work.py)
    enforce_eager: bool  # CUDA: no decode graphs (debugging, or a backend that cannot be captured)
    seed: int | None  # the global generator's, which samples rows without a seed of their own
    max_loras: int  # LoRA adapter slots per rank; 0: LoRA off
    max_lora_rank: int
    lora_modules: dict[str, str]  # adapters loaded at start: name -> PEFT directory
    draft_model: str | None  # speculative decoding's draft model (hub id or directory), on the driver; None: none
    num_speculative_tokens: int  # proposals per request and step, of the draft or the n-gram lookup (0: none)
    # What the engine read from the checkpoints before any rank was configured (read_model_spec, for this tp and
    # quantization), so no rank reads config.json through transformers again.
    model_spec: ModelSpec
    draft_spec: ModelSpec | None  # the draft's; None without one


class Worker:
    """A rank's life: init_device → init_distributed → load_model → determine_num_blocks → init_cache → steps.

    The scheduler sizes the cache with the minimum of all ranks'
    ``determine_num_blocks``, so every rank's block ids mean the same slots.
    Global rank r is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``; only the driver (the last
    stage's first rank; rank 0 without pipelining) samples and returns tokens.
    """

    def __init__(self, config: WorkerConfig, rank: int = 0, gpu_ids: Sequence[int | str] = ()) -> None:
        self.config = config
        self.rank = rank
        self.gpu_ids = list(gpu_ids)  # ray.get_gpu_ids() in a Ray actor; none in-process
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # resolved by load_model, once the checkpoint's dtype is known
        self.kv_dtype = torch.float32  # the KV pages': self.dtype, or FP8 (kv_cache_dtype)
        self.model = None
        self.spec = None
        self.runner: ModelRunner | NoWorkRunner | None = None
        self.cache: CacheEngine | None = None
        self.draft: DraftModel | None = None  # speculative decoding's draft, on the driver only
        self.ranks_on_host = 1  # ranks sharing this host's memory (each pins its own host tier); set by the actor
        self.link: StageLink | None = None
        self.staged_kv: dict[str, np.ndarray] = {}  # transferred KV by request id, until its admission (stage_kv)
        self.kv_exported: dict[str, np.ndarray] = {}  # the last step's KV exports, until the transport takes them
        self.kv_import_s = 0.0  # time writing transferred KV into the cache (raylm bench kv-transfer)
        self.busy_s = 0.0  # time in execute_model, less the time its stage link waited: the bench's busy fraction
        self.model_dir: str | None = None  # the start-up checkpoint, which a wake after sleep(2) reads back
        self.draft_dir: str | None = None
        self.sleep_state = SleepState()
        self.weight_groups: dict[str, WeightGroup] = {}  # by group name: trainers that push weights (weight_group.py)

    def init_device(self) -> str:
        cfg = self.config
        if wants_cuda(cfg.device):
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
            self.device = torch.device("cuda", cuda_index(self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES")))
            torch.cuda.set_device(self.device)
        else:
            keep_freed_memory()
        check_swap_space(
            cfg.swap_space_bytes,
            f"rank {self.rank}'s host",
            pinned=self.device.type == "cuda",
            ranks_on_host=self.ranks_on_host,
        )
        # Ray sets OMP_NUM_THREADS from the actor's num_cpus (often 1); choose on purpose instead.
        threads = cfg.num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        return str(self.device)

    def init_distributed(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str | None = None,
        timeout_s: float = 300,
    ) -> None:
        self.rank = rank
        if world_size == 1:
            return
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        if pp == 1:
            return
        # Every rank creates every stage's group, in the same order (new_group is collective over the world).
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)] if tp > 1 else None
        index = rank // tp
        start, end = partition_layers(self.config.model_spec.num_layers, pp, self.config.pp_layer_partition)[index]
        set_parallel(PipelineStage(index, pp, start, end), groups[index] if groups else None)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tensor_parallel_size

    @property
    def is_driver(self) -> bool:
        return pipeline_stage().is_last and self.tp_rank == 0

    def load_model(self) -> None:
        cfg = self.config
        tp = cfg.tensor_parallel_size
        model_dir = self.model_dir = resolve_model(cfg.model, cfg.revision, cfg.download_dir)
        self.spec = cfg.model_spec
        if cfg.no_work:
            self.runner = NoWorkRunner(self.spec.vocab_size, is_driver=self.is_driver)
            return
        bf16 = self.device.type != "cuda" or torch.cuda.is_bf16_supported()
        self.dtype = resolve_dtype(cfg.dtype, self.spec.dtype, self.device, bf16)
        self.kv_dtype = KV_DTYPES.get(cfg.kv_cache_dtype, self.dtype)
        backend = select_backend(cfg.attention_backend, self.device, cfg.block_size, self.kv_dtype)
        self.model = load_model(
            model_dir,
            dtype=self.dtype,
            device=self.device,
            attn_backend=backend,
            tp_rank=self.tp_rank,
            tp_size=tp,
            expert_parallel=cfg.enable_expert_parallel,
            quantization=cfg.quantization,
            spec=self.spec,
        )
        if self.kv_dtype != self.dtype:
            load_kv_scales(self.model, model_dir)
        lora = None
        if cfg.max_loras:  # before packing: the slots take their sizes from the plain weights
            lora = LoraManager(self.model, self.spec, cfg.max_loras, cfg.max_lora_rank)
            for name, path in cfg.lora_modules.items():
                lora.add(name, path)
        # After the LoRA slots took their dtype from the dequantized weights: adapters stay in the model's dtype.
        if self.device.type == "cuda" and self.spec.quantization is not None:
            fp8_products_where_supported(self.model, self.spec.quantization, self.device, self.dtype)
        if can_pack(self.device, self.dtype):
            pack_for_cpu(self.model)
        # Only graph-capturable backends on CUDA pad decodes to the captured sizes; elsewhere padding is waste.
        # A pipeline stage runs eagerly: its graphs would have to capture the stage-to-stage transfers. MoE and
        # LoRA decodes are captured too: on CUDA their ops read nothing on the host (kernels/triton_moe.py's
        # `align`; each token's adapter slot in the runner's input buffers), so one graph per batch size serves
        # every routing and every mix of adapters. A capture that fails falls back to eager decodes, with a warning.
        stage = pipeline_stage()
        graphs = self.device.type == "cuda" and not cfg.enforce_eager and backend.graph_capturable and stage.count == 1
        if stage.count > 1:
            tp = cfg.tensor_parallel_size
            self.link = StageLink(
                None if stage.is_first else self.rank - tp,
                None if stage.is_last else self.rank + tp,
                self.spec.hidden_size,
                self.dtype,
                self.device,
            )
        grammar = None
        if self.is_driver:
            self._load_draft(backend)
            tokenizer_dir = (
                resolve_model(cfg.tokenizer, cfg.tokenizer_revision, cfg.download_dir, weights=False)
                if cfg.tokenizer
                else model_dir
            )
            grammar = GrammarBitmasks(tokenizer_dir, self.spec.vocab_size, list(self.spec.eos_token_ids), self.device)
        self.runner = ModelRunner(
            self.model,
            backend,
            cfg.block_size,
            cfg.max_model_len,
            self.spec.vocab_size,
            self.spec.eos_token_id,
            self.device,
            is_driver=self.is_driver,
            grammar=grammar,
            link=self.link,
            lora=lora,
            draft=self.draft,
            max_rows=min(cfg.max_num_seqs, 256),
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            decode_sizes=graph_batch_sizes(cfg.max_num_seqs) if graphs else None,
            # Steps verifying k proposals a request replay graphs too (when every request has k).
            graph_query_lens=(1, 1 + cfg.num_speculative_tokens) if cfg.num_speculative_tokens else (1,),
        )

    def _load_draft(self, backend: AttentionBackend) -> None:
        """Speculative decoding's draft model, unsharded, on this (sampling) rank (workers/draft.py says why)."""
        cfg = self.config
        if cfg.draft_model:
            draft_dir = self.draft_dir = resolve_model(cfg.draft_model, None, cfg.download_dir)
            self.draft = DraftModel(
                draft_dir,
                cfg.draft_spec,
                cfg.num_speculative_tokens,
                backend,
                self.dtype,
                self.device,
                cfg.block_size,
                cfg.max_model_len,
            )

    def _new_cache(self, num_blocks: int, num_host_blocks: int = 0) -> CacheEngine:
        cfg, spec = self.config, self.spec
        return CacheEngine(
            pipeline_stage().num_layers(spec.num_layers),
            num_blocks,
            cfg.block_size,
            spec.kv_heads_per_rank(cfg.tensor_parallel_size),
            spec.head_dim,
            self.kv_dtype,
            self.device,
            num_host_blocks,
        )

    def block_bytes(self) -> int:
        """Bytes one block takes on this rank: the target's KV, and the draft's beside it on the driver."""
        spec = self.spec
        target = CacheEngine.block_bytes(
            pipeline_stage().num_layers(spec.num_layers),
            self.config.block_size,
            spec.kv_heads_per_rank(self.config.tensor_parallel_size),
            spec.head_dim,
            self.kv_dtype,
        )
        return target + (self.draft.block_bytes() if self.draft is not None else 0)

    def determine_num_blocks(self) -> int:
        """Blocks this rank can hold. CPU (and the no-work runner, which holds no KV): kv_cache_bytes. GPU: what
        is left after a peak-memory profile and the CUDA graphs' pools."""
        if self.device.type != "cuda" or self.model is None:
            return max(self.config.kv_cache_bytes // self.block_bytes(), 0)
        profile = self._profile_memory()
        budget = kv_cache_budget(
            profile.total,
            self.config.gpu_memory_utilization,
            profile.before,
            profile.after,
            profile.peak,
            self._graph_pools(profile),
        )
        return max(budget // self.block_bytes(), 0)

    def _profile_memory(self) -> MemoryProfile:
        """The peak-memory profile (CUDA): the target's largest step (profile_forward), then the draft's forward over
        its tokens (profile_draft), each on a throwaway cache of `_profile_blocks()` blocks that goes back to the
        driver before `after` is read."""
        # `before` is read before the profile (weights, CUDA context, others): read after, it would also count
        # what the profile left in torch's caching allocator, which the peak already counts.
        torch.cuda.empty_cache()
        before = MemorySnapshot.take()
        blocks = self._profile_blocks()
        cache = self._new_cache(blocks)
        cache.bind(self.model.attention_layers)
        peak, forward_peak = _measured(self.profile_forward)
        CacheEngine.unbind(self.model.attention_layers)
        del cache
        draft_forward_peak = 0
        if self.draft is not None:
            self.draft.init_cache(blocks, 0)
            draft_peak, draft_forward_peak = _measured(self.profile_draft)
            # A step's draft catch-up runs after the target's forward, whose activations are freed by then but for
            # its hidden states (held for the logits, a small part of either peak, not held here): the larger of the
            # two peaks is the step's.
            peak = max(peak, draft_peak)
            self.draft.drop_cache()
        torch.cuda.empty_cache()  # hand the profile's blocks back, for the real caches
        return MemoryProfile(
            torch.cuda.mem_get_info()[1], before, MemorySnapshot.take(), peak, forward_peak, draft_forward_peak
        )

    def _graph_pools(self, profile: MemoryProfile) -> int:
        """The CUDA graphs' private pools, captured after the cache is sized, each estimated from its model's
        measured forward peak (graph_pool_bytes): the target's, and the draft's, a pool of its own at the target's
        shapes (DraftModel.capture_graphs), verification shapes of up to max_num_seqs * (1 + k) tokens included."""
        tokens = sum(self._profile_lens())
        pools = graph_pool_bytes(profile.forward_peak, tokens, self.runner.decode_graphs.max_graph_tokens())
        if self.draft is not None:
            pools += graph_pool_bytes(profile.draft_forward_peak, tokens, self.draft.graphs.max_graph_tokens())
        return pools

    def determine_num_host_blocks(self) -> int:
        """Blocks of the host tier: swap_space_bytes of them, or 0 (no tier) when that is under 2 blocks (the
        host pool, like the device one, keeps a block 0 unused) or there is no KV cache at all."""
        if self.model is None:
            return 0
        n = self.config.swap_space_bytes // self.block_bytes()
        return n if n >= 2 else 0

    def swap_cost_per_block(self) -> float:
        """The time to copy one block to the host tier and back, in units of the time to compute one token: the
        cost model of preemption_mode="auto" (Scheduler._swap_pays), from round figures for this device."""
        spec, device = self.spec, self.device.type
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        params = spec.num_layers * spec.hidden_size * (2 * q + 2 * kv + 3 * spec.intermediate_size)
        params += spec.vocab_size * spec.hidden_size
        token_s = 2 * params / FLOPS_PER_S[device]  # a forward does 2 FLOPs per weight per token
        return 2 * self.block_bytes() / HOST_LINK_BYTES_PER_S[device] / token_s

    def _profile_lens(self) -> list[int]:
        cfg = self.config
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        seq = min(cfg.max_model_len, num_tokens)
        return [seq] * (num_tokens // seq) + ([num_tokens % seq] if num_tokens % seq else [])

    def _profile_blocks(self) -> int:
        lens = self._profile_lens()
        return len(lens) * -(-lens[0] // self.config.block_size) + 1

    @torch.inference_mode()
    def profile_forward(self) -> int:
        """The largest step the scheduler may send (a forward over max_num_batched_tokens tokens), then logits
        and the sampler at max_num_seqs rows (1 + k each with k proposals to verify) with every sampling feature
        on, and prompt logprobs of every token; the KV cache bound to the layers must hold `_profile_blocks()`
        blocks. Its peak memory is what a busy step needs beside the cache. Returns the forward's own peak (bytes
        over what was allocated at its start; 0 off CUDA), from which the graphs' pool is estimated."""
        stage = pipeline_stage()
        shape = (sum(self._profile_lens()), self.spec.hidden_size)
        intermediate = None if stage.is_first else (torch.zeros(shape, dtype=self.dtype, device=self.device),) * 2
        hidden, forward_peak = self._profile_model(self.model, intermediate)
        if stage.is_last:
            self.runner.profile_sampling(hidden, self._max_logits_rows())
        return forward_peak

    @torch.inference_mode()
    def profile_draft(self) -> int:
        """The draft's catch-up on profile_forward's step (the draft's own cache bound must hold `_profile_blocks()`
        blocks). Returns its forward's own peak (0 off CUDA), from which the draft's graph pool is estimated."""
        return self._profile_model(self.draft.model)[1]

    def _profile_model(self, model: torch.nn.Module, intermediate=None) -> tuple[torch.Tensor, int]:
        """`model`'s forward over the profile's step: its output and its own peak (bytes over what was allocated
        at its start; 0 off CUDA)."""
        positions, md = self._profile_step()
        cuda = self.device.type == "cuda"
        start = torch.cuda.memory_allocated() if cuda else 0
        hidden = model(torch.zeros_like(positions), positions, md, intermediate)
        return hidden, (torch.cuda.max_memory_allocated() - start if cuda else 0)

    def _profile_step(self) -> tuple[torch.Tensor, AttentionMetadata]:
        """The positions and attention metadata of the profile's step: `_profile_lens()` prompts from position 0,
        each in blocks of its own from block 1 on."""
        cfg = self.config
        lens = self._profile_lens()
        dev = self.device
        blocks_per_seq = -(-lens[0] // cfg.block_size)
        tables = torch.arange(1, len(lens) * blocks_per_seq + 1, dtype=torch.int32, device=dev).view(len(lens), -1)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        seq_ids = torch.cat([torch.full((n,), i, device=dev) for i, n in enumerate(lens)])
        slots = tables[seq_ids, positions // cfg.block_size].long() * cfg.block_size + positions % cfg.block_size
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
        md = AttentionMetadata.build(
            query_start_loc=cu,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=tables,
            slot_mapping=slots,
            max_query_len=max(lens),
            max_seq_len=max(lens),
            backend=self.runner.attn_backend,
        )
        return positions, md

    def _max_logits_rows(self) -> int:
        """The most logits rows a step samples: one per request, or 1 + k per request verifying k proposals (as
        many as the step's tokens allow)."""
        cfg = self.config
        k = cfg.num_speculative_tokens
        return (
            min(cfg.max_num_seqs * (1 + k), max(cfg.max_num_batched_tokens, cfg.max_num_seqs))
            if k
            else cfg.max_num_seqs
        )

    def init_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        if self.model is None:  # the no-work runner reads no KV
            return
        self._bind_caches(num_blocks, num_host_blocks)
        if self.runner.decode_graphs.sizes:
            self.runner.capture_decode_graphs()

    def _bind_caches(self, num_blocks: int, num_host_blocks: int) -> None:
        self.cache = self._new_cache(num_blocks, num_host_blocks)
        self.cache.bind(self.model.attention_layers)
        if self.draft is not None:
            self.draft.init_cache(num_blocks, num_host_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.finish(self.launch(scheduler_output))

    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Queue the step on the device (ModelRunner.launch): its swaps, its forward and sampling, and the read of
        the KV it exports; ``finish`` gives its output."""
        so = scheduler_output
        start = time.perf_counter()
        waited = self.link.wait_s if self.link is not None else 0.0
        if (so.blocks_to_swap_out or so.blocks_to_swap_in) and self.cache is not None:
            with torch.inference_mode():
                self.cache.swap(so.blocks_to_swap_out, so.blocks_to_swap_in)  # before the forward: its contract
                if self.draft is not None:
                    self.draft.swap(so.blocks_to_swap_out, so.blocks_to_swap_in)
        if self.staged_kv:
            self._import_kv(so)
        pending = self.runner.launch(so)
        if so.kv_exports:
            self.kv_exported = {rid: self.cache.read_blocks(ids) for rid, ids in so.kv_exports.items()}
        self.busy_s += time.perf_counter() - start - ((self.link.wait_s - waited) if self.link is not None else 0.0)
        return pending

    def finish(self, pending: PendingStep) -> ModelRunnerOutput | None:
        """A launched step's output, once its sampled ids are on the host (every step launched before it
        finishes first)."""
        start = time.perf_counter()
        out = self.runner.finish(pending)
        self.busy_s += time.perf_counter() - start
        return out

    # ---- prefill/decode disaggregation: this rank's share of a request's KV ------------------------

    def kv_heads(self) -> tuple[int, int]:
        """The first of the model's KV heads this rank holds, and how many (layers.qkv_shards' split)."""
        spec, tp = self.spec, self.config.tensor_parallel_size
        return self.tp_rank * spec.num_kv_heads // tp, spec.kv_heads_per_rank(tp)

    def take_kv_exports(self) -> dict[str, np.ndarray]:
        """The KV the last step exported (SchedulerOutput.kv_exports), by request id, once."""
        exported, self.kv_exported = self.kv_exported, {}
        return exported

    def stage_kv(self, req_id: str, parts: list[tuple[int, np.ndarray]]) -> None:
        """Keep a request's transferred KV until the step that admits it writes it into its blocks: ``parts`` are
        (first head, array) of another engine's ranks; this rank keeps its own heads of them. A ValueError when
        they lack one of its heads."""
        start, num = self.kv_heads()
        self.staged_kv[req_id] = own_heads(parts, start, num)

    def drop_staged_kv(self, req_id: str) -> None:
        self.staged_kv.pop(req_id, None)

    def _import_kv(self, so: SchedulerOutput) -> None:
        """Write the KV staged for the requests this step admits with a transfer (after the swaps, before the
        forward: SchedulerOutput's order), and drop what is staged for requests that left or were admitted
        without it (their prefix was evicted, so they compute it)."""
        staged = self.staged_kv
        start = time.perf_counter()
        with torch.inference_mode():
            for rid, kv_import in so.kv_imports.items():
                blocks = staged.pop(rid)
                n = len(kv_import.block_ids)
                self.cache.write_blocks(kv_import.block_ids, blocks[:, :, kv_import.offset : kv_import.offset + n])
        self.kv_import_s += time.perf_counter() - start
        for rid in so.finished_req_ids:
            staged.pop(rid, None)
        for new in so.scheduled_new_reqs:
            staged.pop(new.req_id, None)

    def add_lora(self, name: str, path: str) -> None:
        """Read adapter `name` into host memory (a ValueError naming it and the mismatch if it does not fit)."""
        self._lora().add(name, path)

    def remove_lora(self, name: str) -> None:
        self._lora().remove(name)

    def _lora(self) -> LoraManager:
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError("LoRA is not enabled on this engine: start it with enable_lora")
        return lora

    # ---- RL rollouts (issue #71): sleep and wake, weights pushed from a trainer ------------------------

    def sleep(self, level: int) -> None:
        """Give memory back until wake_up. Level 1: the KV cache (the draft's too, and the host tiers), and on CUDA
        the weights' device copies, kept in pinned host memory (on CPU they stay: the host is where they would go).
        Level 2: the KV cache and the weights, plain and CPU-packed, the draft's too; read back from the start-up
        checkpoint on waking, but for what an update writes meanwhile (SleepState). The KV cache's contents are lost
        either way (the scheduler must drop its cached prefixes). The memory goes back to the system
        (return_freed_memory: malloc_trim on CPU, where keep_freed_memory keeps freed pages; empty_cache on CUDA).
        CUDA decode graphs go too (they hold the freed addresses) and are captured again on waking: that CUDA path
        has not run on a GPU. ValueError for a level other than 1 or 2."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        state = self.sleep_state
        weights = level == 2 or self.device.type == "cuda"
        if self.model is not None:
            self.runner.decode_graphs.graphs.clear()
            if self.draft is not None:
                self.draft.graphs.graphs.clear()
            if "kv_cache" not in state.asleep and self.cache is not None:
                self._free_kv()
            if weights:
                self._sleep_weights(level)
        state.asleep.update(("kv_cache", "weights") if weights else ("kv_cache",))
        return_freed_memory(self.device)

    def _free_kv(self) -> None:
        host = self.cache.host_cache
        self.sleep_state.kv_blocks = (self.cache.num_blocks, 0 if host is None else host.shape[2])
        CacheEngine.unbind(self.model.attention_layers)
        self.cache = None
        if self.draft is not None:
            self.draft.drop_cache()

    def _sleep_weights(self, level: int) -> None:
        state = self.sleep_state
        params = [p for m in self._models() for p in m.parameters()]
        if "weights" not in state.asleep and level == 1:
            state.offloaded = offload(params)
        elif not state.freed and level == 2:
            state.freed = [(p, host.shape) for p, host in state.offloaded] if state.offloaded else free(params)
            state.offloaded = []
            for model in self._models():
                drop_packed(model)

    def _models(self) -> list[torch.nn.Module]:
        return [self.model] + ([self.draft.model] if self.draft is not None else [])

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what sleep gave up, of `tags` ("weights", "kv_cache"; None: both; ValueError naming another).
        KV: fresh zeroed caches of the same block counts, bound to the layers. Weights after level 1: the host
        copies; after level 2: zeros, every start-up checkpoint tensor that no update wrote since read back once
        the KV cache is awake too. Once nothing sleeps, CUDA decode graphs are captured again."""
        tags = check_tags(tags)
        state = self.sleep_state
        if self.model is not None:
            if "weights" in tags and "weights" in state.asleep:
                self._wake_weights()
            if "kv_cache" in tags and "kv_cache" in state.asleep and state.kv_blocks is not None:
                self._bind_caches(*state.kv_blocks)
        state.asleep.difference_update(tags)
        if self.model is None or state.asleep:
            return
        if state.reload is not None:
            self._reload()
        graphs = self.runner.decode_graphs
        if graphs.sizes and not graphs.graphs and self.cache is not None:
            self.runner.capture_decode_graphs()

    def _wake_weights(self) -> None:
        state = self.sleep_state
        if state.offloaded:
            restore(state.offloaded, self.device)
            state.offloaded = []
            return
        allocate(state.freed)
        state.freed = []
        state.reload = set(_checkpoint_names(self.model))

    def _reload(self) -> None:
        """After sleep(2): the start-up checkpoint's tensors no update wrote, and the draft's (never updated)."""
        pack = can_pack(self.device, self.dtype)
        weight_update.reload(self.model, self.model_dir, self.sleep_state.reload, self.dtype, pack)
        if self.draft is not None:
            load_weights(self.draft.model, self.draft_dir, self.draft.spec.quantization)
            if pack:
                pack_for_cpu(self.draft.model)
        self.sleep_state.reload = None

    def is_sleeping(self) -> bool:
        return bool(self.sleep_state.asleep)

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Full tensors by Hugging Face checkpoint name, all or none (workers/weight_update.py): each rank takes its
        shards through the start-up load's weight loaders; a ValueError names a refused tensor, every parameter as
        it was. Weights must be awake; the KV cache may sleep (an update between wake_up(["weights"]) and
        wake_up(["kv_cache"]) is what a wake after sleep(2) keeps)."""
        if self.model is None:  # the no-work runner holds no weights
            return
        self._check_weights_awake("update")
        pack = can_pack(self.device, self.dtype)
        self._wrote(weight_update.update_weights(self.model, named_tensors, self.dtype, pack))

    def update_weights_from_disk(self, model_path: str) -> None:
        """Every weight this rank holds from the checkpoint at `model_path`, all or none, as update_weights."""
        if self.model is None:
            return
        self._check_weights_awake("update")
        pack = can_pack(self.device, self.dtype)
        self._wrote(weight_update.update_weights_from_disk(self.model, model_path, self.dtype, pack))

    def _wrote(self, names: set[str]) -> None:
        if self.sleep_state.reload is not None:
            self.sleep_state.reload -= names

    def _check_weights_awake(self, what: str) -> None:
        if "weights" in self.sleep_state.asleep:
            raise ValueError(f"cannot {what} weights while they sleep: wake_up(['weights']) first")

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        """A CPU copy of this rank's parameter `name` (raylm's parameter names); ValueError naming it when unknown."""
        if self.model is None:
            raise ValueError(f"no parameter {name}: this rank runs no model (no_work)")
        self._check_weights_awake("read")
        return weight_update.get_weight(self.model, name)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str | None = None,
    ) -> None:
        """Join a trainer's group `group_name` (workers/weight_group.py) as rank rank_offset + this rank; the trainer
        is rank 0. backend None: NCCL on CUDA, else gloo. Returns once every member joined."""
        if group_name in self.weight_groups:
            raise ValueError(f"weight update group {group_name!r} exists on rank {self.rank}: destroy it first")
        rank = rank_offset + self.rank
        backend = backend or default_backend(self.device)
        self.weight_groups[group_name] = join(master_address, master_port, rank, world_size, group_name, backend)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None:
        """One bucket broadcast by the trainer over `group_name` (weight_group.receive), then update_weights. It is
        received before anything about it is refused, so the trainer's broadcast never waits on this rank."""
        tensors = receive(self._weight_group(group_name), dtypes, shapes)
        if len(names) != len(tensors):
            raise ValueError(f"weight update bucket has {len(names)} names and {len(tensors)} dtypes and shapes")
        self.update_weights(list(zip(names, tensors)))

    def destroy_weights_update_group(self, group_name: str) -> None:
        leave(self._weight_group(group_name))
        del self.weight_groups[group_name]

    def _weight_group(self, group_name: str) -> WeightGroup:
        if group_name not in self.weight_groups:
            raise ValueError(f"no weight update group {group_name!r} on rank {self.rank}: init_weights_update_group")
        return self.weight_groups[group_name]

    def check_health(self) -> bool:
        return self.runner is not None


def _measured(profile: Callable[[], int]) -> tuple[int, int]:
    """A profile's peak as the device sees it (profile_peak, over the allocator's state at its start) and the
    forward's own peak that `profile` returns (CUDA only)."""
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    forward_peak = profile()
    torch.cuda.synchronize()
    peak = profile_peak(allocated, torch.cuda.max_memory_allocated(), reserved, torch.cuda.max_memory_reserved())
    return peak, forward_peak


def own_heads(parts: list[tuple[int, np.ndarray]], start: int, num: int) -> np.ndarray:
    """KV heads ``start .. start + num - 1`` out of other ranks' arrays (axis 4 is the head; each part's first head
    given), whatever the tensor-parallel split that made them. A part that is exactly those heads (equal splits) is
    kept as it is, no copy (from the object store it is a read-only view, which the import's write into the cache
    copies once); otherwise each run of heads a part holds is copied into a new array."""
    runs = []
    head, end = start, start + num
    while head < end:
        part = next(((first, a) for first, a in parts if first <= head < first + a.shape[4]), None)
        if part is None:
            held = [f"{first}..{first + a.shape[4] - 1}" for first, a in parts]
            raise ValueError(f"transferred KV holds heads {held}: this rank needs head {head} ({start}..{end - 1})")
        first, array = part
        stop = min(end, first + array.shape[4])
        runs.append(
            array if (head, stop) == (first, first + array.shape[4]) else array[..., head - first : stop - first, :]
        )
        head = stop
    if len(runs) == 1:
        return runs[0] if any(runs[0] is a for _, a in parts) else np.array(runs[0])
    return np.concatenate(runs, axis=4)
