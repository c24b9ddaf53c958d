"""Triton kernels for CUDA that fuse the Llama block's elementwise work, one launch each: the residual add with
RMSNorm, SiLU with the product of SwiGLU, and RoPE (after Qwen3's per-head q/k norm, where the model has it) with
the store of keys and values into the paged cache.

Unfused, torch spends about 14 small launches a layer on this work (docs/gpu.md): at a decode step of an 8B model
each is latency, not bandwidth, and together they cost a quarter of the step. The rounding follows transformers'
modules in the model's dtype (a sum rounded before its norm, the normalised value rounded before the weight, SiLU
rounded before the product), so an fp32 model gives the torch path's values and a half one the same roundings.
All arithmetic is written in fp32 with explicit roundings (`.to(dtype).to(tl.float32)`): a product of two half values is exact in
fp32, so rounding it once gives what the half product gives, and Triton's interpreter computes half arithmetic
on the raw bits, which would leave bf16 untestable on CPU.

The tests run them on CPU tensors under TRITON_INTERPRET=1, which triton reads when `@triton.jit` decorates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import FP8_MAX, TRITON_DTYPES

# Triton's name of each dtype the kernels take (kernels/fused.py keeps the list).
TL_DTYPES = {d: getattr(tl, str(d).removeprefix("torch.")) for d in TRITON_DTYPES}
# Elements per program of SiLU-and-product: an 8B model's 14,336 units per row are 14 programs a row.
_SILU_BLOCK = 1024


def _num_warps(elements: int) -> int:
    """Warps for a program of `elements` values: about 8 values a thread, 1 to 16 warps."""
    return min(16, max(1, elements // 256))


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=ok, other=0.0)
        xf = (xf + residual.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(residual_ptr + row * stride_residual + cols, xf.to(x_ptr.dtype.element_ty), mask=ok)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [T, N] (rows may be strided, columns contiguous); with `residual`, first
    ``residual += x`` in place and the norm of that sum."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        eps,
        N=n,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        num_warps=_num_warps(block),
    )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    y = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for each row of x = [gate | up] [T, 2n] (columns contiguous): [T, n]."""
    n = x.shape[-1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    grid = (x.shape[0], triton.cdiv(n, _SILU_BLOCK))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n, BLOCK=_SILU_BLOCK, num_warps=4)
    return out


@triton.jit
def _rotary_store_kv_kernel(
    qk_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    eps,
    stride_qk_t,
    stride_qk_h,
    stride_v_t,
    stride_v_h,
    stride_cos,
    stride_slot,
    stride_head,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """One token: its query and key heads (rows [0, NUM_HEADS) and [NUM_HEADS, NUM_HEADS + KV_HEADS) of qk)
    each normed (QK_NORM) and rotated Neox style in their two halves; the queries written back, the keys to
    their cache slot beside the values."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    d_ok = d < HALF
    ok = (h < NUM_HEADS + KV_HEADS) & d_ok
    src = qk_ptr + token * stride_qk_t + h * stride_qk_h + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        is_q = h < NUM_HEADS
        w1 = tl.where(
            is_q, tl.load(q_norm_ptr + d, mask=d_ok, other=0.0), tl.load(k_norm_ptr + d, mask=d_ok, other=0.0)
        )
        w2 = tl.where(
            is_q,
            tl.load(q_norm_ptr + HALF + d, mask=d_ok, other=0.0),
            tl.load(k_norm_ptr + HALF + d, mask=d_ok, other=0.0),
        )
        x1 = ((x1 * rstd).to(DTYPE).to(tl.float32) * w1.to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = ((x2 * rstd).to(DTYPE).to(tl.float32) * w2.to(tl.float32)).to(DTYPE).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    # As transformers rounds: each product in the model's dtype, then their sum.
    y1 = ((x1 * cos).to(DTYPE).to(tl.float32) - (x2 * sin).to(DTYPE).to(tl.float32)).to(DTYPE)
    y2 = ((x2 * cos).to(DTYPE).to(tl.float32) + (x1 * sin).to(DTYPE).to(tl.float32)).to(DTYPE)
    q_ok = ok & (h < NUM_HEADS)
    tl.store(src, y1, mask=q_ok)
    tl.store(src + HALF, y2, mask=q_ok)

    slot = tl.load(slot_ptr + token)
    k_ok = ok & (h >= NUM_HEADS)
    dst = slot * stride_slot + (h - NUM_HEADS) * stride_head + d
    if FP8:
        y1 = tl.clamp(y1.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        y2 = tl.clamp(y2.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + dst, y1.to(k_cache_ptr.dtype.element_ty), mask=k_ok)
    tl.store(k_cache_ptr + dst + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=k_ok)

    hv = tl.arange(0, KV_HEADS_PAD)[:, None]
    dv = tl.arange(0, 2 * HALF_PAD)[None, :]
    v_ok = (hv < KV_HEADS) & (dv < 2 * HALF)
    v = tl.load(v_ptr + token * stride_v_t + hv * stride_v_h + dv, mask=v_ok, other=0.0)
    if FP8:
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    tl.store(v_cache_ptr + slot * stride_slot + hv * stride_head + dv, v.to(v_cache_ptr.dtype.element_ty), mask=v_ok)


def rotary_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
) -> torch.Tensor:
    """The queries of qk [T, heads + kv_heads, D] (each head's last dimension contiguous) rotated in place and
    returned as a view [T, heads, D]; its keys rotated into `kv_cache` [2, blocks, block_size, kv_heads, D] at
    `slot_mapping` beside v [T, kv_heads, D]. cos and sin are [T, 1, D/2] rows of the rotary tables. `qk_norm`:
    (query weight, key weight, eps) of a per-head RMSNorm applied first (Qwen3), or None."""
    _, _, _, kv_heads, head_dim = kv_cache.shape
    num_heads = qk.shape[1] - kv_heads
    k_cache, v_cache = (kv_cache[i].view(-1, kv_heads, head_dim) for i in (0, 1))
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (qk, qk, 0.0)
    half = head_dim // 2
    _rotary_store_kv_kernel[(qk.shape[0],)](
        qk,
        v,
        cos,
        sin,
        q_norm,
        k_norm,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        eps,
        qk.stride(0),
        qk.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        NUM_HEADS=num_heads,
        KV_HEADS=kv_heads,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(qk.shape[1]),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        QK_NORM=qk_norm is not None,
        FP8=kv_cache.dtype == torch.float8_e4m3fn,
        FP8_MAX=FP8_MAX,
        DTYPE=TL_DTYPES[qk.dtype],
        num_warps=_num_warps(qk.shape[1] * head_dim),
    )
    return qk[:, :num_heads]
