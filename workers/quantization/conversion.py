"""FP8 products made from a loaded model's dequantized weights (`fp8_products`), layer by layer and MoE block by
block, where the checkpoint's layout and the device allow; what stays dequantized is logged with why."""

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from kernels.formats import FP8_MAX, block_unsupported
from kernels.fp8 import quantize_rows, quantize_tiles, shape_unsupported, unsupported
from workers.layers import ColumnParallelLinear, RowParallelLinear
from workers.models.moe import SparseMoeBlock
from workers.parallel import tp_group
from workers.quantization.config import WeightQuantization

logger = logging.getLogger(__name__)


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
