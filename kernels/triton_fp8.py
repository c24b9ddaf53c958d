"""FP8 on CUDA (kernels/fp8.py states the numerics): the per-token (and per token group) quantization of
activations, and the product of FP8 operands with tile scales.

The quantization is one launch: one program per row and group finds the group's largest magnitude, its scale
(that / 448, at least MIN_SCALE) and the group divided by it in float8_e4m3fn: the torch path's values (a tiny
negative value may round to -0 there, +0 here).

All arithmetic is fp32 (the interpreter computes half arithmetic on the raw bits), divisions are correctly rounded
(`div_rn`: CUDA's default fp32 division is approximate, which would move a value across an FP8 rounding boundary
now and then), and each value is rounded onto FP8's grid (`_fp8_grid`) before the cast: on CUDA the cast then has
nothing left to round, and Triton's interpreter, whose cast loses the carry of a mantissa rounded up (124.6 becomes
64, not 128), gets values it need not round.

The block product (`block_scaled_mm`) steps through K by `block_step` columns, so each step's two FP8 tiles have one
scale per activation row and one per weight tile: tl.dot's fp32 sum of the step, times both, added to an fp32
accumulator. Its tiles are chosen by the row count (small ones at decode, so that a batch of one spreads the
weight over enough programs to read it at the memory's speed), not measured yet. The tests run both on CPU tensors
under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import FP8_MAX, MIN_SCALE, block_step, block_unsupported
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
def _quantize_groups_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    stride_out,
    stride_scale,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    ok = (cols < K) & (cols < (group + 1) * GROUP)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), _FP8_MAX), _MIN_SCALE)
    y = _fp8_grid(tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX))
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * stride_scale + group, scale)


def quantize_per_token(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (fp32, fp16 or bf16; rows may be strided, columns contiguous) as (float8_e4m3fn [T, K],
    float32 scales [T, ceil(K / group)]; [T, 1] when `group` is None)."""
    rows, k = x.shape
    group = group or k
    groups = triton.cdiv(k, group)
    out = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(group)
    _quantize_groups_kernel[(rows, groups)](
        x,
        out,
        scale,
        x.stride(0),
        out.stride(0),
        scale.stride(0),
        K=k,
        GROUP=group,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out, scale


@triton.jit
def _block_scaled_mm_kernel(
    out_ptr,
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Output rows [pid0 * BM, +BM) x columns [pid1 * BN, +BN) of (x * x_scale) @ (w * w_scale)^T + bias, where x
    [M, K] and w [N, K] are FP8 and contiguous, x_scale [M, cdiv(K, TILE_COLS)] and w_scale [cdiv(N, TILE_ROWS),
    cdiv(K, TILE_COLS)] float32. BK divides TILE_COLS: a step never straddles two tiles."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < M, cols < N
    groups: tl.constexpr = (K + TILE_COLS - 1) // TILE_COLS
    x_rows = x_ptr + rows[:, None].to(tl.int64) * K
    w_cols = w_ptr + cols[None, :].to(tl.int64) * K
    w_scale_rows = w_scale_ptr + (cols // TILE_ROWS) * groups
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        depth = k0 + tl.arange(0, BK)
        depth_ok = depth < K
        x = tl.load(x_rows + depth[None, :], row_ok[:, None] & depth_ok[None, :], 0.0)
        w = tl.load(w_cols + depth[:, None], col_ok[None, :] & depth_ok[:, None], 0.0)
        x_scale = tl.load(x_scale_ptr + rows * groups + k0 // TILE_COLS, row_ok, 0.0)
        w_scale = tl.load(w_scale_rows + k0 // TILE_COLS, col_ok, 0.0)
        acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, col_ok, 0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        row_ok[:, None] & col_ok[None, :],
    )


def block_scaled_mm(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x [M, K] float8_e4m3fn with x_scale [M, ceil(K / block[1])], times weight [N, K] float8_e4m3fn with
    weight_scale [ceil(N / block[0]), ceil(K / block[1])] transposed, plus bias [N]: [M, N] in `out_dtype`;
    ValueError for tiles whose step is too short for a GPU's 8-bit dot (kernels/fp8.py `block_unsupported`)."""
    if why := block_unsupported(block):
        raise ValueError(why)
    x, weight, x_scale, weight_scale = (
        x.contiguous(),
        weight.contiguous(),
        x_scale.contiguous(),
        weight_scale.contiguous(),
    )
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 32 if m <= 16 else 128
    _block_scaled_mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        out,
        x,
        x_scale,
        weight,
        weight_scale,
        out if bias is None else bias,
        m,
        N=n,
        K=k,
        TILE_ROWS=block[0],
        TILE_COLS=block[1],
        HAS_BIAS=bias is not None,
        BM=bm,
        BN=bn,
        BK=block_step(block[1]),
        num_warps=4,
    )
    return out
