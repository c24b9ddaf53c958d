"""A quantized checkpoint's weights read through their scales (`read_weight`): float8 weights dequantized as a
tensor-parallel rank slices them, static activation scales checked, and `--quantization fp8`'s rounding of a plain
checkpoint."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.fp8 import dequantize_rows, quantize_rows
from workers.layers import TensorSlice
from workers.quantization.config import WeightQuantization

PLAIN_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a plain weight may be stored in
FP8_DTYPE = "F8_E4M3"


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
