"""FP8 products (W8A8): x W^T + b with W float8_e4m3fn and its float32 scales, x quantized per token as it comes
(dynamic: each row's largest magnitude / 448 is its scale) or, for row-wise weights, with one fixed scale a static
checkpoint gives (`quantize_per_tensor`), output in x's dtype. Two weight layouts:

- one scale per output row: x quantized per token (or per tensor), then one `torch._scaled_mm` that reads both FP8
  operands, multiplies by the row-wise scales (a static scale repeated over the rows: `_scaled_mm` takes either
  two single scales or two row-wise ones, never one of each) and writes x's dtype. On CUDA it needs compute
  capability 8.9 or above, K and N multiples of 16 (its operands 16-byte aligned), and, depending on the torch
  build, a bf16 output (fp16 and fp32 came later): `unsupported` probes it once for a device and dtype, and
  `shape_unsupported` names a layer whose shape it cannot take.
- one scale per [rows, cols] tile (`block`: Qwen3-FP8's and DeepSeek-V3's 128x128): x quantized per token and
  group of `cols` columns, as those checkpoints were made to run (DeepSeek-V3's recipe), so that each step of the
  reduction multiplies two FP8 tiles that each have one scale per row; a Triton kernel on CUDA
  (kernels/triton_fp8.py: `_scaled_mm` takes no tile scales), the same sums in fp32 through torch elsewhere.
  `block_unsupported` names a tile the kernel cannot step through.

A weight becomes FP8 in either layout through `quantize_rows` and `quantize_tiles` (any device, in float64, so
its FP8 values do not depend on the dtype it was held in). The activations' quantization per token is one Triton
kernel on CUDA (kernels/triton_fp8.py), torch's ops elsewhere; per tensor it is torch's ops everywhere (nothing to
reduce). CPU runs the row-wise numerics through torch's own `_scaled_mm`. The static path has not run on a GPU.
"""

from __future__ import annotations

import torch

from kernels import fused
from kernels.formats import FP8_MAX, MIN_SCALE

MIN_CAPABILITY = (8, 9)
ALIGNMENT = 16


def quantize_rows(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales [out, 1]): each row scaled so that its largest magnitude is FP8's
    largest value, 448. Divisions are made in float64, so the FP8 values do not depend on the input's dtype.
    `amax` [out, 1]: the rows' largest magnitudes where `weight` holds only some columns of them (default: its
    own)."""
    amax = weight.abs().amax(dim=1, keepdim=True) if amax is None else amax
    scale = (amax.double().clamp(min=MIN_SCALE) / FP8_MAX).float()
    stored = (weight.double() / scale.double()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return stored, scale


def dequantize_rows(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return stored.to(torch.float32) * scale


def quantize_tiles(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales [ceil(out / rows), ceil(in / cols)]): each `block` [rows, cols] tile
    (smaller at the ends) scaled so that its largest magnitude is 448, as `quantize_rows` scales rows."""
    (out, cols), (tile_rows, tile_cols) = weight.shape, block
    grid_rows, grid_cols = -(-out // tile_rows), -(-cols // tile_cols)
    padded = torch.nn.functional.pad(weight, (0, grid_cols * tile_cols - cols, 0, grid_rows * tile_rows - out))
    tiles = padded.view(grid_rows, tile_rows, grid_cols, tile_cols)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = (amax.double().clamp(min=MIN_SCALE) / FP8_MAX).float()
    stored = (tiles.double() / scale.double()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return stored.view(grid_rows * tile_rows, grid_cols * tile_cols)[:out, :cols].contiguous(), scale


def quantize_experts(
    weights: torch.Tensor, block: tuple[int, int] | None, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn experts [E, N, K], float32 scales [E, N] per row or [E, ceil(N / rows), ceil(K / cols)] per
    `block` tile) of `weights`, an expert at a time (one expert's float64 copy beside them). `amax` [E, N, 1]: the
    rows' largest magnitudes where the weights hold only some columns of them."""
    stored = torch.empty(weights.shape, dtype=torch.float8_e4m3fn, device=weights.device)
    scales = []
    for expert, weight in enumerate(weights):
        if block is None:
            stored[expert], scale = quantize_rows(weight, None if amax is None else amax[expert])
            scales.append(scale.view(-1))
        else:
            stored[expert], scale = quantize_tiles(weight, block)
            scales.append(scale)
    return stored, torch.stack(scales)


def quantize_per_token(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as (float8_e4m3fn [T, K], float32 scales [T, G]): x ~ out * scale, each row's groups of `group`
    columns (G = ceil(K / group); the whole row, G = 1, when `group` is None) scaled so that the group's largest
    magnitude is 448."""
    if fused.on_triton(x) and x.stride(-1) == 1:
        from kernels.triton_fp8 import quantize_per_token as triton_quantize  # triton only where it runs

        return triton_quantize(x, group)
    rows, k = x.shape
    group = group or k
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(rows, groups, group)
    scale = (xf.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    out = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return out.view(rows, groups * group)[:, :k], scale.view(rows, groups)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as (float8_e4m3fn [T, K], float32 scales [T, 1]) with one fixed float32 `scale` (0-d; a static
    checkpoint's input scale) repeated over the rows, as `quantize_per_token` gives its own: x ~ out * scale,
    divided in fp32 as a GPU's kernels divide, magnitudes past 448 * scale saturating at +-448."""
    stored = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    # repeat, not expand: a one-token step's expanded [1, 1] counts as contiguous with strides (0, 0), which
    # `_scaled_mm` refuses (row-wise scales need stride 1 along the row).
    return stored, scale.view(1, 1).repeat(x.shape[0], 1)


def round_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] rounded through FP8 at the fixed `scale`, back in x's dtype: the activations a static FP8 product
    multiplies, for a product whose weight is held dequantized."""
    return (quantize_per_tensor(x, scale)[0].float() * scale).to(x.dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] (bf16 or fp16; fp32 where the build takes it) times `weight` [N, K] float8_e4m3fn, plus `bias` [N]
    of x's dtype: [T, N] in x's dtype. `weight_scale`: float32 [N] (one per row), or [ceil(N / rows),
    ceil(K / cols)] with `block` = (rows, cols). `input_scale` (row-wise weights only): x's fixed float32 scale
    (0-d), a static checkpoint's; None quantizes x per token."""
    if block is not None:
        return block_fp8_linear(x, weight, weight_scale, block, bias)
    x_fp8, x_scale = quantize_per_token(x) if input_scale is None else quantize_per_tensor(x, input_scale)
    return torch._scaled_mm(
        x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), bias=bias, out_dtype=x.dtype
    )


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8_linear with tile scales: x quantized per token and group of block[1] columns, then the sum over K's
    groups of each group's FP8 product times its two scales, in fp32."""
    x_fp8, x_scale = quantize_per_token(x, block[1])
    if fused.on_triton(x):
        from kernels.triton_fp8 import block_scaled_mm

        return block_scaled_mm(x_fp8, x_scale, weight, weight_scale, block, bias, x.dtype)
    y = fp8_values(x_fp8, x_scale, (1, block[1])) @ fp8_values(weight, weight_scale, block).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def fp8_values(stored: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """The fp32 values float8 `stored` [..., N, K] stands for: times `scale` [..., N], one per row (`tile` None),
    or [..., ceil(N / rows), ceil(K / cols)], one per `tile` [rows, cols] (the last ones of a dimension smaller)."""
    if tile is None:
        return stored.float() * scale.unsqueeze(-1)
    n, k = stored.shape[-2:]
    per_element = scale.repeat_interleave(tile[0], dim=-2)[..., :n, :].repeat_interleave(tile[1], dim=-1)[..., :k]
    return stored.float() * per_element


def shape_unsupported(out_features: int, in_features: int) -> str | None:
    """Why `_scaled_mm` cannot take a weight [out, in] on CUDA, or None."""
    if out_features % ALIGNMENT or in_features % ALIGNMENT:
        return (
            f"torch._scaled_mm needs both dimensions multiples of {ALIGNMENT}, the weight is "
            f"[{out_features}, {in_features}]"
        )
    return None


def unsupported(device: torch.device, dtype: torch.dtype, block: tuple[int, int] | None = None) -> str | None:
    """Why FP8 products with an output of `dtype` (row-wise scales, or `block` tile scales) cannot run on CUDA
    `device`, or None: its compute capability, or a small product with a bias failing in this build (`_scaled_mm`
    refusing the dtype, the block kernel failing to compile)."""
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        have, need = ".".join(map(str, capability)), ".".join(map(str, MIN_CAPABILITY))
        return f"compute capability {have} has no FP8 tensor cores (FP8 products need {need} or above)"
    size = ALIGNMENT if block is None else max(ALIGNMENT, *block)
    weight = torch.ones(size, size, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.ones(size if block is None else (1, 1), dtype=torch.float32, device=device)
    x = torch.ones(1, size, dtype=dtype, device=device)
    try:
        fp8_linear(x, weight, scale, torch.zeros(size, dtype=dtype, device=device), block)
        torch.cuda.synchronize(device)
    except Exception as e:  # whatever the build raises (a missing kernel, a Triton compile error): not here
        how = (
            "torch._scaled_mm with row-wise scales"
            if block is None
            else f"the Triton kernel, {block[0]}x{block[1]} tiles"
        )
        return f"FP8 products ({how}) with a {dtype} output fail on this build: {e}"
    return None
