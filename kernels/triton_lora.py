"""The batched LoRA op on CUDA (kernels/lora.py states it): per token, gather its slot's A and B.

Two kernels per layer: a shrink, one program per token, h[t] = A[slot(t)] x[t] over the layer's n stacked
down-projections; then an expand per fused output j, one program per (token, column tile), y[t, cols] +=
h[t, j] B_j[slot(t)][:, cols]. A token of the base model (slot -1) adds nothing and reads no adapter weights. No host
work: the slots are a device tensor, so the op never syncs and a decode step stays one fixed shape, which a CUDA
graph captures once for every mix of adapters. The tests run it on CPU tensors under
TRITON_INTERPRET=1 against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_K, _BLOCK_N = 64, 64  # the shrink's reduction step, the expand's column tile


@triton.jit
def _shrink_kernel(
    h_ptr, x_ptr, a_ptr, slots_ptr, K: tl.constexpr, NR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    """h[t, :NR] = A[slot] [NR, K] x[t] [K], zeros for slot -1; x is [T, K], A [slots, NR, K], h [T, NR]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    base = tl.maximum(slot, 0).to(tl.int64) * NR * K
    r = tl.arange(0, BLOCK_R)
    r_ok = (r < NR) & (slot >= 0)  # a base-model token reads no adapter weights
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + t * K + k, k_ok, 0.0).to(tl.float32)
        a = tl.load(a_ptr + base + r[:, None] * K + k[None, :], r_ok[:, None] & k_ok[None, :], 0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    acc = tl.where(slot >= 0, acc, 0.0)
    tl.store(h_ptr + t * NR + r, acc, r_ok)


@triton.jit
def _expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slots_ptr,
    y_stride,
    offset,
    h_start,
    N: tl.constexpr,
    R: tl.constexpr,
    NR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[t, offset + cols] += h[t, h_start : h_start + R] B[slot] [R, N] for the tile's cols; nothing for slot -1."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    col_ok, r_ok = cols < N, (r < R) & (slot >= 0)
    h = tl.load(h_ptr + t * NR + h_start + r, r_ok, 0.0)
    base = tl.maximum(slot, 0).to(tl.int64) * N * R
    b = tl.load(b_ptr + base + r[None, :] * N + cols[:, None], col_ok[:, None] & r_ok[None, :], 0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)
    out = y_ptr + t * y_stride + offset + cols
    mask = col_ok & ((cols * 0 + slot) >= 0)  # a block, not a scalar: the interpreter takes only block masks
    y = tl.load(out, mask, 0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask)


def triton_add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bs: list[torch.Tensor],
    offsets: list[int],
    token_slots: torch.Tensor,
) -> None:
    """y [T, out] += each token's adapter product, in place; `token_slots` [T] (int64, -1: none) on y's device.
    Shapes as kernels/lora.py's add_lora; y's rows may be strided (a view), its columns contiguous."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    x, lora_a = x.contiguous(), lora_a.contiguous()
    nr, k = lora_a.shape[1], lora_a.shape[2]
    rank = lora_bs[0].shape[1]
    h = torch.empty(num_tokens, nr, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens,)](h, x, lora_a, token_slots, k, nr, triton.next_power_of_2(nr), _BLOCK_K)
    for j, (b, offset) in enumerate(zip(lora_bs, offsets)):
        n = b.shape[2]
        grid = (num_tokens, triton.cdiv(n, _BLOCK_N))
        _expand_kernel[grid](
            y,
            h,
            b.contiguous(),
            token_slots,
            y.stride(0),
            offset,
            j * rank,
            n,
            rank,
            nr,
            triton.next_power_of_2(rank),
            _BLOCK_N,
        )
