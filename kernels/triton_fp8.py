"""The per-token FP8 quantization of activations on CUDA (kernels/fp8.py states it), one launch: one program per
row finds the row's largest magnitude, its scale (that / 448, at least MIN_SCALE) and the row divided by it in
float8_e4m3fn: the torch path's values (a tiny negative value may round to -0 there, +0 here).

All arithmetic is fp32 (the interpreter computes half arithmetic on the raw bits), divisions are correctly rounded
(`div_rn`: CUDA's default fp32 division is approximate, which would move a value across an FP8 rounding boundary
now and then), and each value is rounded onto FP8's grid (`_fp8_grid`) before the cast: on CUDA the cast then has
nothing left to round, and Triton's interpreter, whose cast loses the carry of a mantissa rounded up (124.6 becomes
64, not 128), gets values it need not round. The tests run it on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_MAX, MIN_SCALE
from kernels.triton_fused import _num_warps

# float8_e4m3fn: 3 mantissa bits; its smallest normal exponent, below which the spacing stays that binade's.
_MANTISSA_BITS = tl.constexpr(3)
_MIN_NORMAL_EXPONENT = tl.constexpr(-6)
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _fp8_grid(y):
    """fp32 `y` (|y| <= 448) rounded to the nearest float8_e4m3fn value, ties to even. Adding 1.5 * 2^23 times
    the FP8 spacing of y's binade and subtracting it again leaves y rounded to that spacing by fp32's own
    round-to-nearest-even; the spacing is 2^(exponent - 3), built from the exponent bits."""
    exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, _MIN_NORMAL_EXPONENT + 127)
    # 1.5 * 2^(e - 3 + 23), e = exponent - 127: biased exponent + 20, mantissa 0.5.
    magic = (((exponent - _MANTISSA_BITS + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (y + magic) - magic


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_out, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), _FP8_MAX), _MIN_SCALE)
    y = _fp8_grid(tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX))
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (fp32, fp16 or bf16; rows may be strided, columns contiguous) as (float8_e4m3fn [T, K],
    float32 scales [T, 1])."""
    rows, k = x.shape
    out = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(rows,)](
        x, out, scale, x.stride(0), out.stride(0), K=k, BLOCK=block, num_warps=_num_warps(block)
    )
    return out, scale
