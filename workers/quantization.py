"""Quantized checkpoints: a Hugging Face `quantization_config` resolved per layer, and FP8 weights read through
their scales.

Two forms of FP8 weights load: `quant_method: fp8` (transformers' fine-grained FP8 and vLLM's: per tensor with
`weight_scale`, or per `weight_block_size` tile with `weight_scale_inv`, as Qwen3-FP8 and DeepSeek-V3 publish)
and compressed-tensors' float 8-bit weights (`weight_scale` per tensor, per output channel or per
`block_structure` tile). Either way a weight is float8_e4m3fn and its real value is the stored value times its
scale: `weight_scale_inv` is multiplied too, despite its name (it is the inverse of the factor the weight was
multiplied by when quantized). Every other method is refused by name: a quantized weight is never read as if it
were a plain one.

Activations are quantized dynamically, per token as they come (fp8's `activation_scheme: dynamic`;
compressed-tensors' `input_activations` float 8-bit and dynamic, or none), or statically (`activation_scheme:
static`; `input_activations` float 8-bit, `dynamic: false`, strategy `tensor`) with one fixed scale per layer, the
checkpoint's `<layer>.input_scale` (one float32 element, whole on every tensor-parallel rank; missing, mis-shaped
or not positive, refused naming it): x / scale in fp32, clamped to +-448, float8_e4m3fn. A fused layer (q/k/v,
gate/up) takes the largest of its parts' scales (its one input is quantized once), and is refused where only some
parts are static. A MoE block's experts take the largest of their experts' scales for each of their two products
(`SparseMoeBlock`: the grouped products quantize their whole input at once), and are refused where only some are
static or under expert parallel (a rank holds only its experts' scales). Refused by name: any other input
activations (integer, other widths, asymmetric, static per token or channel), static ones with block weights, and
static scales on routers or the LM head (plain products).

`--quantization fp8` (vLLM's flag) quantizes a plain checkpoint at load as vLLM's dynamic FP8 does, per output
channel: each row of each linear weight (not the embeddings, the LM head or the norms) becomes float8_e4m3fn with
a float32 scale, its largest magnitude / 448. On a checkpoint that is already `fp8` the flag changes nothing; on
one quantized by another method it is refused, naming both.

The weights are dequantized at load, on every device, into the model's compute dtype. On CPU they stay so: FP8's
numerics at bf16's (or fp32's) memory and speed, dynamic activations left unquantized, static ones still rounded
through FP8 at their scale before each product (`round_per_tensor`: a GPU's activations).

On a CUDA GPU of compute capability 8.9 or above, once the model is loaded (and its LoRA slots made, in the model's
dtype), `fp8_products` makes every linear layer whose checkpoint modules are quantized an FP8 one, layer by layer,
its products W8A8 (kernels/fp8.py): half the bytes a decode step reads. Its weight is requantized from the
dequantized one as the checkpoint laid it out, so a checkpoint's own FP8 values come back:
- per tensor, per channel, or by `--quantization fp8`: per output row (`quantize_rows`, each row at the scale the
  checkpoint stored it with, a per-tensor one's repeated over its rows, so that its values come back exactly),
  float32 scales [out], activations quantized per token (static ones per tensor, their scale repeated over the
  rows), one `torch._scaled_mm` with row-wise scales. A row-parallel rank's columns keep their whole rows' scales
  (the checkpoint's, or under `--quantization fp8` their maxima reduced over the tensor-parallel group), so the
  ranks together hold what one rank would;
- per block (Qwen3-FP8's and DeepSeek-V3's 128x128 tiles): per tile (`quantize_tiles`), float32 scales
  [out / rows, in / cols], activations quantized per token and group of `cols` columns, a Triton kernel.
Kept dequantized, and logged once with why: a fused layer (qkv_proj, gate_up_proj) one of whose checkpoint modules
the config leaves plain or lays out otherwise; a row-wise layer whose dimensions are not multiples of 16; a block
layer whose tensor-parallel slice (or fused part) starts or ends inside a tile, or whose tile's columns the kernel
cannot step through; and every layer on a GPU below 8.9, or where this build's `_scaled_mm` refuses the model's
dtype (fp32, on older builds fp16) or the block kernel fails to compile. The ranks of a tensor-parallel group
agree on those probes. A MoE block's experts become FP8 alike (`SparseMoeBlock.to_fp8`), all of them in one layout:
per expert and output row (float32 scales [E_local, rows], any shape) or per tile of each expert's matrix, their
products W8A8 in raylm's Triton grouped matmul (kernels/triton_moe.py); kept dequantized, and logged with why, where
a checkpoint module feeding them is plain or laid out otherwise, where this rank's units cut the tiles
(`SparseMoeBlock.tiles_cut`), or where the tile's columns are ones the kernel cannot step through. The embeddings,
the LM head and the routers are never FP8: dequantized in the model's dtype. Untested on a GPU
(tests/gpu/test_fp8.py; the experts' kernel has run only under Triton's interpreter; static activations have run
only through torch's CPU `_scaled_mm`).
"""

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from kernels.formats import FP8_MAX, block_unsupported
from kernels.fp8 import (
    dequantize_rows,
    quantize_rows,
    quantize_tiles,
    shape_unsupported,
    unsupported,
)
from workers.layers import ColumnParallelLinear, RowParallelLinear, TensorSlice
from workers.models.moe import SparseMoeBlock
from workers.parallel import tp_group

logger = logging.getLogger(__name__)

SUPPORTED_METHODS = ("fp8", "compressed-tensors (float 8-bit weights)")
AT_LOAD_METHODS = ("fp8",)  # --quantization's values: engine.config.choices.QUANTIZATIONS
PLAIN_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a plain weight may be stored in
FP8_DTYPE = "F8_E4M3"
STRATEGIES = ("tensor", "channel", "block")
# The activations a compressed-tensors group may quantize (input_activations): block weights take dynamic ones.
ACTIVATIONS = ("float 8-bit dynamic", "float 8-bit static per tensor (with tensor or channel weights)")
# Files that older tools write beside config.json instead of a quantization_config: their method, named.
QUANT_CONFIG_FILES = {"quantize_config.json": "gptq", "hf_quant_config.json": "modelopt"}


@dataclass(slots=True, frozen=True)
class Fp8Scheme:
    """How a quantized layer's weight [out, in] is stored: float8_e4m3fn with the scale tensor
    `<layer>.<scale_name>`, one scale for the whole weight (`tensor`), one per output row (`channel`) or one per
    `block` [rows, cols] tile (`block`; the last tiles of a dimension the block does not divide are smaller).
    `static`: its activations are quantized with one fixed scale, the checkpoint's `<layer>.input_scale` (never
    with block scales); else per token as they come."""

    strategy: str
    scale_name: str
    block: tuple[int, int] | None = None
    static: bool = False

    def scale_grid(self, name: str, scale: torch.Tensor, out: int, cols: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """The scales as a float32 grid [ceil(out / rows), ceil(in / cols)] and the tile [rows, cols] each covers;
        ValueError naming the scale tensor when its shape is not the one this scheme gives a [out, in] weight."""
        if self.strategy == "tensor":
            expected, tile, ok = "one element", (out, cols), scale.numel() == 1
        elif self.strategy == "channel":
            expected, tile = f"[{out}] or [{out}, 1]", (1, cols)
            ok = tuple(scale.shape) in ((out,), (out, 1))
        else:
            tile = self.block
            grid = (-(-out // tile[0]), -(-cols // tile[1]))
            expected, ok = str(list(grid)), tuple(scale.shape) == grid
        if not ok:
            raise ValueError(
                f"scale tensor {name} has shape {list(scale.shape)} in the checkpoint, expected {expected} "
                f"({self.strategy} scales of a [{out}, {cols}] weight)"
            )
        return scale.to(torch.float32).reshape(-(-out // tile[0]), -(-cols // tile[1])), tile


@dataclass(slots=True, frozen=True)
class WeightQuantization:
    """A checkpoint's quantization_config, resolved: a linear layer takes the scheme of the first of `groups`
    whose targets it matches ("Linear": every linear layer; a layer's name; "re:" and a regex matched from its
    start), unless a pattern of `ignore` (regexes, searched in the layer's name) names it: then its weight is a
    plain one. `method` is the config's quant_method, for messages. `at_load`: the checkpoint is a plain one, and
    the layers with a scheme are quantized per output channel as they load (`--quantization fp8`)."""

    method: str
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    ignore: tuple[str, ...] = ()
    at_load: bool = False

    def scheme(self, layer: str) -> Fp8Scheme | None:
        if any(re.search(pattern, layer) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_targets(t, layer) for t in targets):
                return scheme
        return None


def _targets(target: str, layer: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], layer) is not None
    return target == layer


@dataclass(slots=True)
class DequantizedSlice:
    """A float8 weight [out, in] read as a TensorSlice: each read of a range of rows and columns (what a
    tensor-parallel rank takes) returns those elements times their own scales, in float32. The scales are indexed
    per element, so a slice that cuts a tile gets that tile's scale on its part of it: weight and scales are always
    sliced together. `input_scale`: the layer's static activation scale (0-d float32), whole on every rank (it is
    one per tensor), None where its activations are dynamic."""

    weight: TensorSlice
    grid: torch.Tensor
    tile: tuple[int, int]
    input_scale: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def row_scales(self, start: int, end: int) -> torch.Tensor | None:
        """The float32 scale of each of rows [start, end) where every row has one (per tensor or channel, or tiles
        as wide as the weight), else None: what requantizing the rows needs to give back the stored values."""
        if self.grid.shape[1] != 1:
            return None
        return self.grid[torch.arange(start, end) // self.tile[0], 0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        r0, r1, c0, c1 = _ranges(index, self.get_shape())
        tile_rows, tile_cols = self.tile
        w = self.weight[r0:r1, c0:c1].to(torch.float32)
        scales = self.grid[torch.arange(r0, r1) // tile_rows]
        for j in range(c0 // tile_cols, -(-c1 // tile_cols)):  # a column of tiles at a time: scales never expanded
            lo, hi = max(c0, j * tile_cols) - c0, min(c1, (j + 1) * tile_cols) - c0
            w[:, lo:hi] *= scales[:, j : j + 1]
        return w


@dataclass(slots=True)
class QuantizedAtLoad:
    """A plain weight [out, in] read as `--quantization fp8` stores it: each row float8_e4m3fn times a float32
    scale of its own (the row's largest magnitude / 448), returned dequantized in float32. A read of some columns
    quantizes its rows whole, so a tensor-parallel rank's slice holds exactly what the whole weight holds there."""

    weight: TensorSlice

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        r0, r1, c0, c1 = _ranges(index, self.get_shape())
        return dequantize_rows(*quantize_rows(self.weight[r0:r1]))[:, c0:c1]


def _ranges(index: Any, shape: list[int]) -> tuple[int, int, int, int]:
    """Rows [r0, r1) and columns [c0, c1) that `index` (a slice of rows, optionally a slice of columns) reads."""
    index = index if isinstance(index, tuple) else (index,)
    rows, columns = (*index, slice(None))[:2]
    return *_bounds(rows, shape[0]), *_bounds(columns, shape[1])


def _bounds(index: Any, size: int) -> tuple[int, int]:
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise TypeError(f"a quantized weight is read by contiguous ranges of rows and columns, not {index!r}")
    start, stop, _ = index.indices(size)
    return start, max(start, stop)


def fp8_products_where_supported(
    model: nn.Module, quantization: WeightQuantization, device: torch.device, dtype: torch.dtype
) -> None:
    """fp8_products on a CUDA `device` that runs FP8 products in `dtype`; elsewhere the weights stay dequantized,
    and why is logged. The tensor-parallel ranks agree first (a rank that cannot counts for all): one converting a
    row-parallel layer that another keeps would wait forever in its all-reduce, and their sums would differ."""
    why = _agreed(unsupported(device, dtype), "FP8 products fail on another tensor-parallel rank's GPU")
    if why is None:
        probes: dict[tuple[int, int], str | None] = {}

        def block_unsupported_here(block: tuple[int, int]) -> str | None:
            if block not in probes:
                found = block_unsupported(block) or unsupported(device, dtype, block)
                probes[block] = _agreed(found, f"the {block[0]}x{block[1]} block kernel fails on another rank's GPU")
            return probes[block]

        converted = fp8_products(model, quantization, block_unsupported_here)
        torch.cuda.empty_cache()  # the dequantized weights' memory back to the driver, for the KV cache's budget
        logger.info(
            "raylm: %d linear layers and MoE blocks hold FP8 weights and run FP8 products on %s", len(converted), device
        )
    else:
        logger.warning("raylm: FP8 weights stay dequantized in %s on %s: %s", dtype, device, why)


def _agreed(why: str | None, elsewhere: str) -> str | None:
    """`why` where this rank has a reason; `elsewhere` where only another rank of its tensor-parallel group has
    one; None where none has."""
    if not dist.is_initialized() or dist.get_world_size(tp_group()) == 1:
        return why
    # MIN over the group: 0 wherever a rank found a reason. gloo and NCCL both take a CPU tensor through
    # all_reduce only on their own device, so the flag lives where the group reduces.
    flag = torch.tensor([int(why is None)], device=_group_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tp_group())
    return why or (None if int(flag.item()) else elsewhere)


def _group_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(tp_group()) == "nccl"
        else torch.device("cpu")
    )


def fp8_products(
    model: nn.Module,
    quantization: WeightQuantization,
    kernel_unsupported: Callable[[tuple[int, int]], str | None] = block_unsupported,
) -> list[str]:
    """Give every linear layer of `model` (loaded, its weights dequantized) whose checkpoint modules `quantization`
    quantizes an FP8 weight, requantized from the dequantized one (`_to_fp8`): per output row where the checkpoint
    has one scale per tensor or per channel (or quantizes at load), per tile where it has block scales and
    `kernel_unsupported(block)` has no reason against them. Every MoE block's experts likewise
    (`SparseMoeBlock.to_fp8`). Layer by layer, so the conversion needs one layer's worth of memory beside the
    model. The layers kept dequantized are logged, one line per reason. Returns the converted layers' and MoE
    blocks' names. Any device: the caller decides where it pays."""
    kept: dict[tuple[str, torch.dtype, str], list[str]] = {}  # (what they are, their dtype, why) -> their names
    converted = []
    for name, layer in model.named_modules():
        if isinstance(layer, ColumnParallelLinear | RowParallelLinear):
            what, weight, convert = "linear layers", layer.weight, partial(_to_fp8, layer)
            block, why = _fp8_layout(quantization, name, layer)
        elif isinstance(layer, SparseMoeBlock):
            what, weight, convert = "MoE blocks", layer.w13, layer.to_fp8
            block, why = _experts_fp8_layout(quantization, name, layer)
        else:
            continue
        if why is None and block is not None:
            why = kernel_unsupported(block)
        if why is None:
            convert(block)
            converted.append(name)
        else:
            kept.setdefault((what, weight.dtype, why), []).append(name)
    for (what, dtype, why), names in kept.items():
        logger.warning(
            "raylm: %d %s (%s, ...) keep their weights dequantized in %s: %s", len(names), what, names[0], dtype, why
        )
    return converted


def _fp8_layout(
    quantization: WeightQuantization, name: str, layer: ColumnParallelLinear | RowParallelLinear
) -> tuple[tuple[int, int] | None, str | None]:
    """(the tile of `layer`'s block scales, None for row-wise ones; why it cannot take FP8 products, or None). A
    fused layer (qkv_proj) is fed by several checkpoint modules (q_proj, k_proj, v_proj): every one must be
    quantized, and block-quantized ones alike."""
    block, why = _one_layout(quantization, checkpoint_modules(name, layer))
    if why is not None:
        return None, why
    if block is None:
        return None, shape_unsupported(*layer.weight.shape)
    return block, _tiles_cut(layer, block)


def _experts_fp8_layout(
    quantization: WeightQuantization, name: str, moe: "SparseMoeBlock"
) -> tuple[tuple[int, int] | None, str | None]:
    """_fp8_layout for MoE block `name`'s experts, fed by every local expert's gate, up and down projections. Rows
    take any shape (the grouped kernel masks its tiles; `_scaled_mm` is not used); tiles must not be cut by this
    rank's units."""
    block, why = _one_layout(quantization, moe.expert_modules(name))
    if why is None and block is not None:
        why = moe.tiles_cut(block)
    return block, why


def _one_layout(quantization: WeightQuantization, modules: list[str]) -> tuple[tuple[int, int] | None, str | None]:
    """(the tile of the block scales of checkpoint `modules`, None for row-wise ones; why the weight they feed has no
    one FP8 layout, or None): every one must be quantized, and block-quantized ones alike."""
    schemes = [quantization.scheme(module) for module in modules]
    if None in schemes:
        return None, f"quantization_config ({quantization.method}) leaves a checkpoint module feeding them unquantized"
    blocks = {s.block for s in schemes}
    if len(blocks) > 1:
        tiles = ", ".join("rows" if b is None else f"{b[0]}x{b[1]} blocks" for b in sorted(blocks, key=str))
        return None, f"their checkpoint modules are quantized in different layouts ({tiles})"
    return blocks.pop(), None


def _tiles_cut(layer: ColumnParallelLinear | RowParallelLinear, block: tuple[int, int]) -> str | None:
    """Why this rank's weight, tiled from its first row and column, would not lay its tiles on the checkpoint's
    (a tensor-parallel slice, or a fused layer's part, starting or ending inside a tile), or None: requantized per
    tile, it then holds the checkpoint's FP8 values and scales."""
    rows, cols = block
    if isinstance(layer, RowParallelLinear):
        local = layer.weight.shape[1]
        if layer.rank * local % cols or (local % cols and layer.rank < layer.tp_size - 1):
            return f"this rank's {local} of their {layer.input_size} input columns cut their {rows}x{cols} blocks"
        return None
    for module, s in layer.shards.items():
        if s.offset % rows:
            return f"{module} starts at row {s.offset} of the fused weight, inside one of its {rows}x{cols} blocks"
        if s.start % rows or (s.size % rows and s.start + s.size < s.rows):
            return (
                f"this rank's rows {s.start}..{s.start + s.size} of {module} (of {s.rows}) cut its {rows}x{cols} blocks"
            )
    return None


def checkpoint_modules(name: str, layer: ColumnParallelLinear | RowParallelLinear) -> list[str]:
    """The checkpoint modules whose weights linear layer `name` holds, in its rows' order."""
    if isinstance(layer, RowParallelLinear):
        return [name]
    parent = name.rpartition(".")[0]
    return [f"{parent}.{shard}" for shard in sorted(layer.shards, key=lambda s: layer.shards[s].offset)]


def _to_fp8(layer: ColumnParallelLinear | RowParallelLinear, block: tuple[int, int] | None) -> None:
    weight = layer.weight.detach()
    if block is None and layer.checkpoint_scales is not None:
        # Each row at the scale the checkpoint stored it with: its FP8 values come back exactly (a per-tensor
        # checkpoint's too, which its rows' own maxima would put on other grids, rounding them a second time).
        stored, scale = quantize_rows(weight, layer.checkpoint_scales.to(weight.device).double()[:, None] * FP8_MAX)
        scale = scale.view(-1)
    elif block is None:
        amax = weight.abs().amax(dim=1, keepdim=True).float()
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            # This rank holds some columns of each row: the row's scale is the whole row's, as one rank's would be.
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group())
        stored, scale = quantize_rows(weight, amax)
        scale = scale.view(-1)
    else:
        stored, scale = quantize_tiles(weight, block)
    loader = layer.weight.weight_loader  # kept: a weight update (workers/weight_update.py) stages through it
    layer.weight = nn.Parameter(stored, requires_grad=False)
    layer.weight.weight_loader = loader
    layer.weight_scale, layer.weight_block = scale, block


def read_weight(
    quantization: WeightQuantization | None, name: str, lookup: Callable[[str], TensorSlice | None]
) -> TensorSlice:
    """Checkpoint tensor `name` as the loaders read it: a quantized layer's weight through its scale (found by
    `lookup`, which gives a tensor of the checkpoint or None), with its activations' scale where they are static,
    any other tensor as stored. ValueError naming the tensor when it is stored in a dtype the config does not
    account for, or one of its scales is missing or mis-shaped."""
    tensor = lookup(name)
    dtype = tensor.get_dtype()
    layer, _, leaf = name.rpartition(".")
    is_linear = leaf == "weight" and len(tensor.get_shape()) == 2 and not layer.endswith("embed_tokens")
    scheme = quantization.scheme(layer) if quantization is not None and is_linear else None
    if scheme is None or quantization.at_load:
        if dtype not in PLAIN_DTYPES:
            why = (
                "config.json has no quantization_config"
                if quantization is None or quantization.at_load
                else f"quantization_config ({quantization.method}) leaves {layer} unquantized"
            )
            raise ValueError(
                f"weight {name} is stored as {dtype}, but {why}: raylm reads a quantized weight only with its "
                "scales, as the config describes them"
            )
        return tensor if scheme is None else QuantizedAtLoad(tensor)
    if dtype != FP8_DTYPE:
        raise ValueError(
            f"weight {name} is stored as {dtype}, but quantization_config ({quantization.method}) says {layer} is "
            f"quantized: expected {FP8_DTYPE} (float8_e4m3fn)"
        )
    scale_name = f"{layer}.{scheme.scale_name}"
    scale = lookup(scale_name)
    if scale is None:
        raise ValueError(
            f"scale tensor {scale_name} is missing from the checkpoint: {name} is float8 ({quantization.method}, "
            f"{scheme.strategy} scales) and cannot be read without it"
        )
    grid, tile = scheme.scale_grid(scale_name, scale[...], *tensor.get_shape())
    input_scale = _input_scale(quantization, layer, lookup) if scheme.static else None
    return DequantizedSlice(tensor, grid, tile, input_scale)


def _input_scale(
    quantization: WeightQuantization, layer: str, lookup: Callable[[str], TensorSlice | None]
) -> torch.Tensor:
    """`<layer>.input_scale`, the one float32 scale (0-d) of a static layer's activations; ValueError naming it
    where it is missing, not one element, or not a positive finite number."""
    name = f"{layer}.input_scale"
    scale = lookup(name)
    if scale is None:
        raise ValueError(
            f"scale tensor {name} is missing from the checkpoint: {layer} quantizes its activations statically "
            f"({quantization.method}, one scale per tensor) and cannot run without it"
        )
    value = scale[...]
    if value.numel() != 1:
        raise ValueError(
            f"scale tensor {name} has shape {list(value.shape)} in the checkpoint, expected one element (static "
            "activation scales are per tensor)"
        )
    value = value.to(torch.float32).reshape(())
    if not 0 < float(value) < float("inf"):
        raise ValueError(f"scale tensor {name} is {float(value)} in the checkpoint, expected a positive number")
    return value


def read_quantization(root: Path, requested: str | None = None) -> WeightQuantization | None:
    """The weight quantization of the checkpoint in directory `root` (its config.json's quantization_config), None
    for a plain checkpoint; ValueError naming the method (and listing the supported ones) for anything else.
    `requested` (`--quantization`): a plain checkpoint is quantized at load by that method; a quantized one must
    already be quantized by it."""
    checkpoint = _checkpoint_quantization(root)
    if requested is None:
        return checkpoint
    if requested not in AT_LOAD_METHODS:
        _refuse(requested, " (--quantization)", AT_LOAD_METHODS)
    if checkpoint is None:
        # The LM head and MoE routers stay plain, as vLLM leaves them.
        ignore = ("lm_head", r"\.gate$")
        return WeightQuantization(requested, ((("Linear",), Fp8Scheme("channel", "")),), ignore, at_load=True)
    if checkpoint.method != requested:
        raise ValueError(
            f"--quantization {requested} was asked for, but the checkpoint's quantization_config is "
            f"{checkpoint.method}: serve it without --quantization (its own quantization is read), or quantize an "
            "unquantized checkpoint"
        )
    return checkpoint


def _checkpoint_quantization(root: Path) -> WeightQuantization | None:
    config = json.loads((root / "config.json").read_text())
    for file, method in QUANT_CONFIG_FILES.items():
        if (root / file).is_file() and "quantization_config" not in config:
            _refuse(method, f" ({file})")
    quant = config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    _refuse(method)


def _refuse(method: Any, detail: str = "", supported: tuple[str, ...] = SUPPORTED_METHODS) -> NoReturn:
    raise ValueError(
        f"quantization method {method!r}{detail} is not supported; supported: {list(supported)}. "
        "A quantized checkpoint is never loaded as if its weights were plain ones"
    )


def _block(value: Any, what: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"quantization_config {what}={value!r} must be two positive integers [rows, cols]")
    return tuple(value)


def _fp8(quant: dict[str, Any]) -> WeightQuantization:
    """transformers' and vLLM's `fp8`: every linear layer but lm_head and those `modules_to_not_convert` or
    `ignored_layers` name (as transformers matches them: a substring of the layer's name, "*" for layer numbers)."""
    activations = quant.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {activations!r} is not supported; supported: ['dynamic', 'static']")
    if quant.get("fmt", "e4m3") != "e4m3":
        _refuse("fp8", f" with fmt={quant['fmt']!r}")
    block = quant.get("weight_block_size")
    static = activations == "static"
    if block is None:
        scheme = Fp8Scheme("tensor", "weight_scale", static=static)
    elif static:
        raise ValueError(
            "fp8 activation_scheme 'static' with weight_block_size is not supported: block-wise FP8 weights are "
            "read with dynamic activations only (quantized per token and group of the block's columns), as vLLM "
            "reads them"
        )
    else:
        scheme = Fp8Scheme("block", "weight_scale_inv", _block(block, "weight_block_size"))
    skipped = ["lm_head", *(quant.get("modules_to_not_convert") or ()), *(quant.get("ignored_layers") or ())]
    ignore = tuple(re.escape(m).replace(r"\*", r"\d+") for m in skipped)
    return WeightQuantization("fp8", ((("Linear",), scheme),), ignore)


def _compressed_tensors(quant: dict[str, Any]) -> WeightQuantization:
    """compressed-tensors: each of `config_groups` names its target layers and how their weights are quantized;
    only float 8-bit weights (float-quantized or naive-quantized, symmetric) are read. `ignore` lists layer names
    and "re:" regexes."""
    sparsity = (quant.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        _refuse("compressed-tensors", f" with sparsity format {sparsity!r}")
    groups = []
    for group_name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind = f"{weights.get('type')} {weights.get('num_bits')}-bit weights"
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            _refuse("compressed-tensors", f" with {kind} (group {group_name!r})")
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            _refuse(
                "compressed-tensors", f" with {kind} and strategy {strategy!r}; strategies read: {list(STRATEGIES)}"
            )
        if weights.get("symmetric") is False:
            _refuse("compressed-tensors", f" with asymmetric {kind} (zero points)")
        fmt = group.get("format") or quant.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            _refuse("compressed-tensors", f" with format {fmt!r}")
        block = _block(weights.get("block_structure"), "block_structure") if strategy == "block" else None
        static = _static_activations(group_name, group.get("input_activations"), block)
        groups.append((tuple(group.get("targets") or ()), Fp8Scheme(strategy, "weight_scale", block, static)))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups: nothing says how it is stored")
    ignore = tuple(f"^(?:{p[3:]})" if p.startswith("re:") else f"^{re.escape(p)}$" for p in quant.get("ignore") or ())
    return WeightQuantization("compressed-tensors", tuple(groups), ignore)


def _static_activations(group_name: str, activations: dict[str, Any] | None, block: tuple[int, int] | None) -> bool:
    """Whether compressed-tensors group `group_name` quantizes its `input_activations` statically, with one scale per
    tensor (`input_scale`), rather than dynamically (per token as they come, as raylm's FP8 products also do where
    the group has none); ValueError naming the scheme for any other."""
    if activations is None:
        return False
    dynamic = activations.get("dynamic")
    static = dynamic is False
    if (
        (activations.get("type"), activations.get("num_bits")) != ("float", 8)
        or activations.get("symmetric") is False
        or dynamic not in (True, False)
        or (static and (activations.get("strategy") != "tensor" or block is not None))
    ):
        scheme = (
            f"{activations.get('type')} {activations.get('num_bits')}-bit, dynamic={dynamic!r}, "
            f"strategy={activations.get('strategy')!r}, symmetric={activations.get('symmetric', True)!r}"
        )
        raise ValueError(
            f"compressed-tensors input_activations ({scheme}; group {group_name!r}"
            f"{', block weights' if block is not None else ''}) are not supported; supported: {list(ACTIVATIONS)}"
        )
    return static
