"""Building blocks of the Llama family, split Megatron-style across tensor-parallel ranks.

A sharded layer gives its parameters a `weight_loader(param, tensor, name, shard)` that checks
the checkpoint tensor's full shape and reads only this rank's rows or columns from its lazy
safetensors slice (`safe_open(...).get_slice`): no rank materialises a weight it does not own.
"""

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels import AttentionBackend, AttentionMetadata
from kernels.cpu_ops import small_mm_applies
from kernels.fp8 import fp8_linear, round_per_tensor
from kernels.fused import add_rms_norm, rms_norm, rotary_store_kv
from workers.parallel import MissingLayer, tp_group


class LayerAdapter(Protocol):
    """What wraps a linear layer from outside to add to its product (workers/lora.py's LinearLora, the layer's
    adapter slots): a Protocol, so that the layers import no LoRA and LoRA imports the layers."""

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += the adapter's product of x, in place."""


class TensorSlice(Protocol):
    """What a weight loader reads from: safetensors' lazy slice of one checkpoint tensor. A quantized weight whose
    checkpoint quantizes its activations statically (workers/quantization/) also carries `input_scale`, their
    float32 scale (0-d); `static_input_scale` reads it."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def static_input_scale(tensor: TensorSlice, device: torch.device) -> torch.Tensor | None:
    """The static activation scale `tensor` carries, on `device`; None where its activations are not static."""
    scale = getattr(tensor, "input_scale", None)
    return None if scale is None else scale.to(device)


def checkpoint_row_scales(tensor: TensorSlice, start: int, end: int) -> torch.Tensor | None:
    """The float32 scale each of rows [start, end) of a quantized weight is stored with, where each row has one
    (workers/quantization/checkpoint.py's DequantizedSlice.row_scales), else None."""
    row_scales = getattr(tensor, "row_scales", None)
    return None if row_scales is None else row_scales(start, end)


def refuse_static(name: str, tensor: TensorSlice, what: str) -> None:
    """ValueError naming weight `name` where it carries a static activation scale that its layer (`what`) does not
    apply: without it the layer would not compute what the checkpoint was calibrated for."""
    if getattr(tensor, "input_scale", None) is not None:
        raise ValueError(
            f"weight {name} has a static activation scale (input_scale), which raylm applies in the linear layers "
            f"of attention and MLPs and in MoE experts, not in {what}"
        )


def check_shape(name: str, tensor: TensorSlice, expected: tuple[int, ...]) -> None:
    shape = tuple(tensor.get_shape())
    if shape != expected:
        raise ValueError(f"weight {name} has shape {list(shape)} in the checkpoint, expected {list(expected)}")


# Rows up to which a CPU linear layer reads its plain weight with raylm's op (`small_mm`) rather than its packed
# copy: at 1 to 8 rows oneDNN's fixed cost per call and its slower streaming of the weights made SmolLM2's decode
# step 1.2-1.3x slower; at 16 rows the two are even, and past that oneDNN is faster.
FEW_ROWS = 8

# oneDNN chooses its blocked weight layout for a typical count of activation rows; the packed weight then serves
# any count, from a decode step's few rows to a prefill's thousands.
PACK_ROWS = 64


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered once into oneDNN's blocked layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_block: tuple[int, int] | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T + b: an FP8 weight (one with its `weight_scale`, per row or per `weight_block` tile) through FP8
    products; else at FEW_ROWS rows or fewer
    through raylm's CPU op, else through the packed weight when there is one. `input_scale`: a static checkpoint's
    activation scale, x quantized with it, whether the weight is FP8 or held dequantized."""
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias, weight_block, input_scale)
    if input_scale is not None:  # the activations a GPU's FP8 product would multiply, FP8 at that scale
        x = round_per_tensor(x, input_scale)
    if weight is not None and x.shape[0] <= FEW_ROWS and small_mm_applies(x, weight):
        y = torch.ops.raylm.small_mm(x, weight)
        return y if bias is None else y.add_(bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_for_cpu(model: nn.Module) -> None:
    """Reorder every matmul weight of a loaded model into oneDNN's layout, once.

    F.linear hands its weight to MKL's sgemm, which repacks it on every call: for a decode step's tens of rows
    that repacking is a large part of the product. Prepacked, oneDNN ran SmolLM2's layer products 1.4x faster
    at 64 rows and 1.2x at 2048, and its LM head 2x, still in fp32. The plain weights stay beside the packed
    copies, for steps of FEW_ROWS rows or fewer (`linear`): the model's matmul weights are held twice in host
    memory, which a CPU deployment trades for the faster small steps (for SmolLM2, 0.42 GB more).
    """
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.packed = pack_weight(module.weight)
    head = model.lm_head
    if not isinstance(head, MissingLayer):  # a pipeline stage before the last has no LM head
        head.packed_head = pack_weight(head.weight)


def load_replicated(param: nn.Parameter, tensor: TensorSlice, name: str, _shard: str | None = None) -> None:
    """The loader of parameters that carry no `weight_loader`: weights every rank holds whole."""
    check_shape(name, tensor, tuple(param.shape))
    refuse_static(name, tensor, "a replicated weight (a MoE router)")
    param.data.copy_(tensor[:])


@dataclass(slots=True, frozen=True)
class Shard:
    """Rows [start, start + size) of a checkpoint tensor with `rows` rows in total land at rows
    [offset, offset + size) of this rank's fused weight. Fusing q/k/v (and gate/up) turns three
    (two) matmuls into one, which matters on CPU where each op has a fixed cost."""

    rows: int
    start: int
    size: int
    offset: int


def even_shards(names: tuple[str, ...], rows: int, rank: int, tp_size: int) -> dict[str, Shard]:
    """Equal-sized checkpoint tensors (gate/up) each split evenly over the ranks."""
    size = rows // tp_size
    return {n: Shard(rows, rank * size, size, i * size) for i, n in enumerate(names)}


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, tp_size: int) -> dict[str, Shard]:
    """Query heads split evenly. KV heads split evenly too, unless there are fewer KV heads than
    ranks: then each rank keeps a copy of the one KV head its query heads attend with."""
    q_heads = num_heads // tp_size
    kv_heads = max(num_kv_heads // tp_size, 1)
    kv_start = rank * num_kv_heads // tp_size
    q_rows, kv_rows = q_heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": Shard(num_heads * head_dim, rank * q_rows, q_rows, 0),
        "k_proj": Shard(num_kv_heads * head_dim, kv_start * head_dim, kv_rows, q_rows),
        "v_proj": Shard(num_kv_heads * head_dim, kv_start * head_dim, kv_rows, q_rows + kv_rows),
    }


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b where W stacks this rank's rows of several checkpoint tensors (`shards`,
    keyed by the checkpoint module name). Output stays sharded: no collective."""

    def __init__(self, input_size: int, shards: dict[str, Shard], bias: bool):
        super().__init__()
        self.shards = shards
        out = sum(s.size for s in shards.values())
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.weight.weight_loader = self._load
        self.packed: torch.Tensor | None = None  # set by pack_for_cpu
        # Beside an FP8 weight, set by fp8_products: float32 scales [out], or [out / rows, in / cols] per tile.
        self.weight_scale: torch.Tensor | None = None
        self.weight_block: tuple[int, int] | None = None  # the tile [rows, cols] of block scales
        # A static checkpoint's activation scale (0-d float32), set as the weights load: `_fused_input_scale`.
        self.input_scale: torch.Tensor | None = None
        self._input_scales: dict[str, torch.Tensor | None] = {}  # each shard's, as it loads
        # The scale each of this rank's rows is stored with in the checkpoint, where each has one (per tensor or
        # channel): FP8 products requantize the rows at them (workers/quantization/conversion.py `_to_fp8`).
        self.checkpoint_scales: torch.Tensor | None = None
        self._row_scales: dict[str, torch.Tensor | None] = {}  # each shard's, as it loads
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        if bias:
            self.bias.weight_loader = self._load
        self.lora: LayerAdapter | None = None  # set by workers.lora.LoraManager when LoRA is enabled

    def _load(self, param: nn.Parameter, tensor: TensorSlice, name: str, shard: str) -> None:
        s = self.shards[shard]
        check_shape(name, tensor, (s.rows, *param.shape[1:]))
        param.data[s.offset : s.offset + s.size].copy_(tensor[s.start : s.start + s.size])
        if param is self.weight:
            self._input_scales[shard] = static_input_scale(tensor, param.device)
            self._row_scales[shard] = checkpoint_row_scales(tensor, s.start, s.start + s.size)
            if len(self._input_scales) == len(self.shards):
                self.input_scale = self._fused_input_scale(name.rsplit(".", 2)[0])
                by_offset = [self._row_scales[k] for k in sorted(self.shards, key=lambda k: self.shards[k].offset)]
                self.checkpoint_scales = None if any(r is None for r in by_offset) else torch.cat(by_offset)

    def _fused_input_scale(self, parent: str) -> torch.Tensor | None:
        """The largest of the shards' static input scales, None where none has one. One activation tensor feeds
        every shard (q, k and v; gate and up) and is quantized once, so with the scale that saturates none of
        them, as vLLM takes it. ValueError where some shards have one and others not: one input cannot be
        quantized both statically and not."""
        static = sorted(shard for shard, scale in self._input_scales.items() if scale is not None)
        if not static:
            return None
        if len(static) < len(self.shards):
            others = sorted(set(self.shards) - set(static))
            raise ValueError(
                f"{parent}: {static} quantize their activations statically (an input_scale each) but {others} do "
                "not, and raylm multiplies them together, from one input quantized once"
            )
        return torch.stack([self._input_scales[shard] for shard in static]).amax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.packed, self.bias, self.weight_scale, self.weight_block, self.input_scale)
        if self.lora is not None:
            self.lora.apply(y, x)
        return y


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_rank W_rank^T) + b: W is split along its input dimension, so each rank's
    partial product covers its slice of x (the column-parallel output before it) and the sum over
    ranks is the full result. The bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool, rank: int, tp_size: int):
        super().__init__()
        self.rank, self.tp_size = rank, tp_size
        self.input_size = input_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp_size), requires_grad=False)
        self.weight.weight_loader = self._load_weight
        self.packed: torch.Tensor | None = None  # set by pack_for_cpu
        # Beside an FP8 weight, set by fp8_products: float32 scales [out], or [out / rows, in / cols] per tile.
        self.weight_scale: torch.Tensor | None = None
        self.weight_block: tuple[int, int] | None = None  # the tile [rows, cols] of block scales
        # A static checkpoint's activation scale (0-d float32), set as the weight loads: per tensor, so every rank
        # holds it whole.
        self.input_scale: torch.Tensor | None = None
        # As ColumnParallelLinear's: the scales of the whole rows, whose columns this rank holds some of.
        self.checkpoint_scales: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.output_size = output_size
        self.lora: LayerAdapter | None = None  # set by workers.lora.LoraManager when LoRA is enabled

    def _load_weight(self, param: nn.Parameter, tensor: TensorSlice, name: str, _shard: None) -> None:
        check_shape(name, tensor, (param.shape[0], self.input_size))
        cols = param.shape[1]
        param.data.copy_(tensor[:, self.rank * cols : (self.rank + 1) * cols])
        self.input_scale = static_input_scale(tensor, param.device)
        self.checkpoint_scales = checkpoint_row_scales(tensor, 0, param.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.packed, None, self.weight_scale, self.weight_block, self.input_scale)
        if self.lora is not None:  # this rank's partial adapter product: the all-reduce sums it with the rest
            self.lora.apply(y, x)
        if self.tp_size > 1:
            dist.all_reduce(y, group=tp_group())
        return y if self.bias is None else y + self.bias


LOGITS_SLICE = 4096  # vocabulary rows per LM-head product (see VocabParallelEmbedding.logits)


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * per_rank, (rank + 1) * per_rank) of the vocabulary live on this rank, where
    per_rank = ceil(vocab / tp); rows past the real vocabulary are zero padding. The same weight
    serves as the LM head (tied or not), whose padded logits are cut off after the gather."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, tp_size: int):
        super().__init__()
        self.vocab_size, self.rank, self.tp_size = vocab_size, rank, tp_size
        self.per_rank = math.ceil(vocab_size / tp_size)
        self.start = rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load
        self.packed_head: torch.Tensor | None = None  # the LM head's copy, set by pack_for_cpu

    def _load(self, param: nn.Parameter, tensor: TensorSlice, name: str, _shard: None) -> None:
        check_shape(name, tensor, (self.vocab_size, param.shape[1]))
        refuse_static(name, tensor, "the LM head")
        end = min(self.start + self.per_rank, self.vocab_size)
        param.data[: end - self.start].copy_(tensor[self.start : end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        # Ids owned by another rank contribute zeros here and their row there: the sum is exact.
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(x, group=tp_group())
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary fp32 logits on rank 0, None on the other ranks."""
        if self.packed_head is not None:
            local = linear(hidden, self.weight, self.packed_head).float()
        elif hidden.device.type == "cpu":
            # In vocabulary slices: each slice's weights stay in cache while every row uses them, which measured
            # 15-25% faster than one [rows x vocab] product on a 2-core CPU at 8-128 rows. On a GPU it would only
            # add launches: one product.
            local = torch.cat([F.linear(hidden, w) for w in self.weight.split(LOGITS_SLICE)], dim=-1).float()
        else:
            local = F.linear(hidden, self.weight).float()
        if self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)] if self.rank == 0 else None
        dist.gather(local, parts, group=tp_group(), group_dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size] if parts else None


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension (replicated on every rank). Called with a
    residual it first adds it and returns the sum as the next residual, so each decoder layer
    does one add per norm instead of keeping extra copies around."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual is added to in place: it is the stream this model owns (the embedding's output, then
        the running sum), never a tensor a caller still reads."""
        if residual is None:
            return self(x), x
        return add_rms_norm(x, residual, self.weight, self.eps), residual


@dataclass(slots=True, frozen=True)
class RopeConfig:
    """Rotary position embedding parameters as Hugging Face's `rope_parameters` names them;
    `scaling` holds the type-specific keys (factor, low/high_freq_factor, ...)."""

    theta: float
    rope_type: str = "default"
    scaling: tuple[tuple[str, float], ...] = ()


ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """On CPU, whatever the default device (models are built under `with device:`), as transformers computes
    it: CUDA's pow and division may round differently, and fp32 greedy equality needs the same frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / rope.theta**exponents
    s = dict(rope.scaling)
    if rope.rope_type == "linear":
        return inv_freq / s["factor"]
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        mixed = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
        scaled = torch.where(wavelen > old_len / s["low_freq_factor"], inv_freq / s["factor"], inv_freq)
        is_medium = (wavelen >= old_len / s["high_freq_factor"]) & (wavelen <= old_len / s["low_freq_factor"])
        return torch.where(is_medium, mixed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (the Llama family's `rotate_half` layout) with cos/sin tables
    for every position below `max_positions`, computed once in fp32 and stored in the model dtype
    as Hugging Face does: a step only gathers rows by position, once for all layers."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        inv_freq = _inv_freq(head_dim, rope).to(torch.get_default_device())
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim / 2], ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class Attention(nn.Module):
    """Paged causal attention over this rank's heads. `kv_cache` is
    [2, num_blocks, block_size, num_kv_heads, head_dim] (a view of the worker's one KV tensor,
    set by the CacheEngine; empty until then). Keys and values of this step are stored first, so
    the kernel sees every token of the context, this step's included, through the block table.
    With a sliding `window`, a query sees only its last `window` positions (itself included). `k_scale` and
    `v_scale` are the factors an FP8 cache's keys and values are stored divided by (1.0 unless the checkpoint
    gives them: workers.model_loader.load_kv_scales); a cache of the model's dtype ignores them."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend, window: int | None = None
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.window = window
        self.kv_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0

    def forward(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """qk [T, num_heads + num_kv_heads, head_dim] (queries, then keys) and v [T, num_kv_heads, head_dim] of
        this step, before RoPE (and before Qwen3's per-head norm, `qk_norm`: its query and key weights and eps),
        which are applied with the store of keys and values: one kernel on CUDA (kernels/fused.py)."""
        q = rotary_store_kv(
            qk,
            v,
            cos,
            sin,
            self.kv_cache,
            attn_metadata.slot_mapping,
            self.k_scale,
            self.v_scale,
            qk_norm,
            self.backend.store_kv,
        )
        return self.backend.paged_attention(
            q, self.kv_cache, attn_metadata, self.scale, self.window, self.k_scale, self.v_scale
        )
