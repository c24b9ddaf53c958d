"""Quantized checkpoints: a Hugging Face `quantization_config` resolved per layer, and FP8 weights read through
their scales.

Two forms of FP8 weights load: `quant_method: fp8` (transformers' fine-grained FP8 and vLLM's: per tensor with
`weight_scale`, or per `weight_block_size` tile with `weight_scale_inv`, as Qwen3-FP8 and DeepSeek-V3 publish)
and compressed-tensors' float 8-bit weights (`weight_scale` per tensor, per output channel or per
`block_structure` tile). Either way a weight is float8_e4m3fn and its real value is the stored value times its
scale: `weight_scale_inv` is multiplied too, despite its name (it is the inverse of the factor the weight was
multiplied by when quantized). Every other method is refused by name: a quantized weight is never read as if it
were a plain one.

`--quantization fp8` (vLLM's flag) quantizes a plain checkpoint at load as vLLM's dynamic FP8 does, per output
channel: each row of each linear weight (not the embeddings, the LM head or the norms) becomes float8_e4m3fn with
a float32 scale, its largest magnitude / 448. On a checkpoint that is already `fp8` the flag changes nothing; on
one quantized by another method it is refused, naming both.

The weights are dequantized at load, on every device, into the model's compute dtype (`input_scale` and a static
activation scheme are not used). On CPU they stay so: FP8's numerics at bf16's (or fp32's) memory and speed.

On a CUDA GPU of compute capability 8.9 or above, once the model is loaded (and its LoRA slots made, in the model's
dtype), `fp8_products` makes every linear layer whose checkpoint modules are quantized per tensor or per channel,
or by `--quantization fp8`, an FP8 one, layer by layer: its weight requantized per output row (`quantize_rows`:
a per-channel checkpoint's and --quantization fp8's own FP8 values come back, a per-tensor one's land on a finer
per-row grid) and held as float8_e4m3fn with float32 scales [out], its products W8A8 (kernels/fp8.py: activations
quantized per token as they come, one `torch._scaled_mm` with row-wise scales, output in the model's dtype): half
the bytes a decode step reads. A row-parallel rank's columns keep their whole rows' scales (reduced over the
tensor-parallel group), so the ranks together hold what one rank would. Kept dequantized, and logged once with
why: layers with block-wise scales (Qwen3-FP8's and DeepSeek-V3's 128x128 tiles: a row-wise scaled matmul takes no
tile scales), a fused layer (qkv_proj, gate_up_proj) one of whose checkpoint modules the config leaves plain, a
layer whose dimensions are not multiples of 16, and every layer on a GPU below 8.9 or where this torch build's
`_scaled_mm` refuses the model's dtype (fp32, on older builds fp16). MoE experts, the embeddings, the LM head and
the routers are never FP8: dequantized in the model's dtype. Untested on a GPU (tests/gpu/test_fp8.py).
"""

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from kernels.fp8 import shape_unsupported, unsupported
from workers.layers import ColumnParallelLinear, RowParallelLinear, TensorSlice
from workers.parallel import tp_group

logger = logging.getLogger(__name__)

SUPPORTED_METHODS = ("fp8", "compressed-tensors (float 8-bit weights)")
AT_LOAD_METHODS = ("fp8",)  # --quantization's values: cluster.config.choices.QUANTIZATIONS
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
PLAIN_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a plain weight may be stored in
FP8_DTYPE = "F8_E4M3"
STRATEGIES = ("tensor", "channel", "block")
# Files that older tools write beside config.json instead of a quantization_config: their method, named.
QUANT_CONFIG_FILES = {"quantize_config.json": "gptq", "hf_quant_config.json": "modelopt"}


@dataclass(slots=True, frozen=True)
class Fp8Scheme:
    """How a quantized layer's weight [out, in] is stored: float8_e4m3fn with the scale tensor
    `<layer>.<scale_name>`, one scale for the whole weight (`tensor`), one per output row (`channel`) or one per
    `block` [rows, cols] tile (`block`; the last tiles of a dimension the block does not divide are smaller)."""

    strategy: str
    scale_name: str
    block: tuple[int, int] | None = None

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
    sliced together."""

    weight: TensorSlice
    grid: torch.Tensor
    tile: tuple[int, int]

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

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


def quantize_rows(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales [out, 1]): each row scaled so that its largest magnitude is FP8's
    largest value, 448. Divisions are made in float64, so the FP8 values do not depend on the input's dtype.
    `amax` [out, 1]: the rows' largest magnitudes where `weight` holds only some columns of them (default: its
    own)."""
    amax = weight.abs().amax(dim=1, keepdim=True) if amax is None else amax
    scale = (amax.double().clamp(min=1e-12) / FP8_MAX).float()
    stored = (weight.double() / scale.double()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return stored, scale


def dequantize_rows(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return stored.to(torch.float32) * scale


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
    and why is logged."""
    why = unsupported(device, dtype)
    if why is None:
        converted = fp8_products(model, quantization)
        torch.cuda.empty_cache()  # the dequantized weights' memory back to the driver, for the KV cache's budget
        logger.info("raylm: %d linear layers hold FP8 weights and run FP8 products on %s", len(converted), device)
    else:
        logger.warning("raylm: FP8 weights stay dequantized in %s on %s: %s", dtype, device, why)


def fp8_products(model: nn.Module, quantization: WeightQuantization) -> list[str]:
    """Give every linear layer of `model` (loaded, its weights dequantized) whose checkpoint modules `quantization`
    quantizes per tensor or per channel (or at load) an FP8 weight: each row requantized by `quantize_rows`, the
    float8_e4m3fn weight and its float32 scales [out] (`weight_scale`) replacing the dequantized one layer by layer,
    so the conversion needs one layer's worth of memory beside the model. The layers kept dequantized are logged,
    one line per reason. Returns the converted layers' names. Any device: the caller decides where it pays."""
    kept: dict[str, list[str]] = {}
    converted = []
    for name, layer in model.named_modules():
        if not isinstance(layer, ColumnParallelLinear | RowParallelLinear):
            continue
        why = _why_dequantized(quantization, name, layer)
        if why is None:
            _to_fp8(layer)
            converted.append(name)
        else:
            kept.setdefault(why, []).append(name)
    for why, names in kept.items():
        logger.warning(
            "raylm: %d linear layers (%s, ...) keep their weights dequantized in %s: %s",
            len(names),
            names[0],
            model.get_submodule(names[0]).weight.dtype,
            why,
        )
    return converted


def _why_dequantized(quantization: WeightQuantization, name: str, layer: nn.Module) -> str | None:
    """Why `layer` (module `name`) cannot take FP8 products, or None. A fused layer (qkv_proj) is fed by several
    checkpoint modules (q_proj, k_proj, v_proj): every one must be quantized."""
    schemes = [quantization.scheme(module) for module in checkpoint_modules(name, layer)]
    if None in schemes:
        return f"quantization_config ({quantization.method}) leaves a checkpoint module feeding them unquantized"
    blocks = sorted({s.block for s in schemes if s.strategy == "block"})
    if blocks:
        tiles = ", ".join(f"{rows}x{cols}" for rows, cols in blocks)
        return (
            f"their FP8 scales are per {tiles} block, and torch._scaled_mm's row-wise scaling takes one scale per "
            "output row"
        )
    return shape_unsupported(*layer.weight.shape)


def checkpoint_modules(name: str, layer: ColumnParallelLinear | RowParallelLinear) -> list[str]:
    """The checkpoint modules whose weights linear layer `name` holds, in its rows' order."""
    if isinstance(layer, RowParallelLinear):
        return [name]
    parent = name.rpartition(".")[0]
    return [f"{parent}.{shard}" for shard in sorted(layer.shards, key=lambda s: layer.shards[s].offset)]


def _to_fp8(layer: ColumnParallelLinear | RowParallelLinear) -> None:
    weight = layer.weight.detach()
    amax = weight.abs().amax(dim=1, keepdim=True).float()
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
        # This rank holds some columns of each row: the row's scale is the whole row's, as one rank's would be.
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group())
    stored, scale = quantize_rows(weight, amax)
    layer.weight = nn.Parameter(stored, requires_grad=False)
    layer.weight_scale = scale.view(-1)


def read_weight(
    quantization: WeightQuantization | None, name: str, lookup: Callable[[str], TensorSlice | None]
) -> TensorSlice:
    """Checkpoint tensor `name` as the loaders read it: a quantized layer's weight through its scale (found by
    `lookup`, which gives a tensor of the checkpoint or None), any other tensor as stored. ValueError naming the
    tensor when it is stored in a dtype the config does not account for, or its scale is missing or mis-shaped."""
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
    return DequantizedSlice(tensor, grid, tile)


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
    if block is None:
        scheme = Fp8Scheme("tensor", "weight_scale")
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
        groups.append((tuple(group.get("targets") or ()), Fp8Scheme(strategy, "weight_scale", block)))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups: nothing says how it is stored")
    ignore = tuple(f"^(?:{p[3:]})" if p.startswith("re:") else f"^{re.escape(p)}$" for p in quant.get("ignore") or ())
    return WeightQuantization("compressed-tensors", tuple(groups), ignore)
