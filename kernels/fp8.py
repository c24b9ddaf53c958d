"""FP8 products (W8A8): x W^T + b with W float8_e4m3fn and one float32 scale per output row, and x quantized per
token as it comes (dynamic: each row's largest magnitude / 448 is its scale), then one `torch._scaled_mm` that
reads both FP8 operands, multiplies by the row-wise scales and writes x's dtype.

The quantization is one Triton kernel on CUDA (kernels/triton_fp8.py), torch's ops elsewhere; CPU runs the same
numerics through torch's own `_scaled_mm`. On CUDA, `_scaled_mm` with row-wise scales needs compute capability
8.9 or above, K and N multiples of 16 (its operands 16-byte aligned), and, depending on the torch build, a bf16
output (fp16 and fp32 came later): `unsupported` probes it once for a device and dtype, and `shape_unsupported`
names a layer whose shape it cannot take.
"""

from __future__ import annotations

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# A row of zeros still gets a scale to divide by; real activations are never this small.
MIN_SCALE = 1e-12
MIN_CAPABILITY = (8, 9)
ALIGNMENT = 16


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as (float8_e4m3fn [T, K], float32 scales [T, 1]): x ~ out * scale, each row scaled so that its
    largest magnitude is 448."""
    if x.is_cuda and x.stride(-1) == 1:
        from kernels.triton_fp8 import quantize_per_token as triton_quantize  # triton only where it runs

        return triton_quantize(x)
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (bf16 or fp16; fp32 where the build takes it) times `weight` [N, K] float8_e4m3fn with
    `weight_scale` [N] float32, plus `bias` [N] of x's dtype: [T, N] in x's dtype."""
    x_fp8, x_scale = quantize_per_token(x)
    return torch._scaled_mm(
        x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), bias=bias, out_dtype=x.dtype
    )


def shape_unsupported(out_features: int, in_features: int) -> str | None:
    """Why `_scaled_mm` cannot take a weight [out, in] on CUDA, or None."""
    if out_features % ALIGNMENT or in_features % ALIGNMENT:
        return (
            f"torch._scaled_mm needs both dimensions multiples of {ALIGNMENT}, the weight is "
            f"[{out_features}, {in_features}]"
        )
    return None


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FP8 products with an output of `dtype` cannot run on CUDA `device`, or None: its compute capability,
    or `_scaled_mm` refusing a small row-wise product (with a bias) in this torch build."""
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        have, need = ".".join(map(str, capability)), ".".join(map(str, MIN_CAPABILITY))
        return f"compute capability {have} has no FP8 tensor cores (FP8 products need {need} or above)"
    weight = torch.ones(ALIGNMENT, ALIGNMENT, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.ones(ALIGNMENT, dtype=torch.float32, device=device)
    x = torch.ones(1, ALIGNMENT, dtype=dtype, device=device)
    try:
        fp8_linear(x, weight, scale, torch.zeros(ALIGNMENT, dtype=dtype, device=device))
        torch.cuda.synchronize(device)
    except Exception as e:  # whatever the build raises (a missing kernel, a Triton compile error): not here
        return f"FP8 products (torch._scaled_mm with row-wise scales) with a {dtype} output fail on this build: {e}"
    return None
