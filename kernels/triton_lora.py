"""The batched LoRA op on CUDA (kernels/lora.py states it), in two launches a layer whatever its fused outputs.

Both kernels work on tiles of BLOCK_M consecutive tokens, and within a tile take each adapter slot its tokens use
in turn: one tl.dot for all the tile's tokens of that slot, the others' rows masked, so each adapter's weights are
read once per tile rather than once per token. The model runner groups a step's tokens by slot, so most tiles hold
one slot (one dot); a tile across a boundary between adapters takes one dot per slot. A token of the base model
(slot -1) adds nothing and reads no adapter weights: a tile of base tokens only reads its slots.

- shrink: one program per (token tile, slice of the reduction): h[slice, tile] = x[tile, slice] A[slot][:, slice]^T
  over the layer's n stacked down-projections (fp32 [slices, T, n * R]). The slices keep a small step's GPU busy:
  a decode of a few tokens is one tile, and one program would read every adapter's A (16 adapters of rank 16 on an
  8B model's q/k/v: 6 MB) on one SM, where the slices spread it over up to ~_PROGRAMS of them;
- expand: one program per (token tile, column tile), the column tiles of all the layer's fused outputs (q/k/v: 3,
  gate/up: 2) in one grid, each program finding its output j from its column tile and summing h's slices:
  y[tile, offset_j + cols] += h[:, tile, j * R : (j + 1) * R].sum(0) B_j[slot][:, cols].

No host work: the slots are a device tensor, read only by the kernels, and the grid depends on the token count and
the shapes only, so the op never syncs and a decode step stays one fixed shape, which a CUDA graph captures once
for every mix of adapters. The tests run it on CPU tensors under TRITON_INTERPRET=1 against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_M, _BLOCK_N = 16, 64  # a tile's tokens, the expand's column tile
_MIN_DOT = 16  # tl.dot's least size on any dimension: smaller ranks are padded to it by masked loads
# The shrink's A tile per reduction step: the pipeline keeps a few in shared memory, which must fit sm89's 100 KiB
# in fp32 too.
_STEP_BYTES = 16384
# The most rank columns one dot takes: wider shrinks run more programs and wider expands loop, so a rank-512
# adapter's tiles fit shared memory in fp32 as a rank-16 one's do.
_MAX_BLOCK_R = 128
_MAX_OUTPUTS = 3  # the expand's B pointers: q/k/v
_PROGRAMS = 128  # the shrink's programs a small step aims at: about an H100's or H200's SM count (132)


@triton.jit(do_not_specialize=["num_tokens", "slice_len"])
def _shrink_kernel(
    h_ptr,
    x_ptr,
    a_ptr,
    slots_ptr,
    num_tokens,
    slice_len,
    K: tl.constexpr,
    NR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """h[s, rows, rs] = x[rows, ks] [BLOCK_M, slice_len] A[slot][rs, ks]^T for one tile of BLOCK_M tokens, slice
    s of the reduction, ks = [s * slice_len, (s + 1) * slice_len) within K (slice_len a multiple of BLOCK_K), and
    BLOCK_R columns rs of NR (program ids 0, 1, 2), one dot over the slice per slot among the tile's rows; zeros
    for slot -1 rows, none for rows past T. x is [T, K], A [slots, NR, K], h float32 [slices, T, NR]."""
    k_first = tl.program_id(1) * slice_len
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_tokens
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < NR
    left = tl.load(slots_ptr + rows, row_ok, -1)  # each row's slot until its product is in acc, then -1
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    slot = tl.max(left, 0)
    while slot >= 0:
        mine = left == slot
        a_base = a_ptr + slot * NR * K
        for k0 in range(0, slice_len, BLOCK_K):
            k = k_first + k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            # Other slots' rows load zeros: their part of this dot adds exact zeros to their sums.
            x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mine[:, None] & k_ok[None, :], 0.0)
            a = tl.load(a_base + r[None, :] * K + k[:, None], k_ok[:, None] & r_ok[None, :], 0.0)
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
        left = tl.where(mine, -1, left)
        slot = tl.max(left, 0)
    h = h_ptr + tl.program_id(1).to(tl.int64) * num_tokens * NR
    tl.store(h + rows[:, None] * NR + r[None, :], acc, row_ok[:, None] & r_ok[None, :])


@triton.jit
def _pick(j, v0, v1, v2):
    """v0, v1 or v2 as j is 0, 1 or 2."""
    return tl.where(j == 0, v0, tl.where(j == 1, v1, v2))


@triton.jit(do_not_specialize=["num_tokens", "num_slices"])
def _expand_kernel(
    y_ptr,
    h_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    slots_ptr,
    num_tokens,
    num_slices,
    y_stride,
    offset0,
    offset1,
    offset2,
    N0: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    R: tl.constexpr,
    NR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[rows, offset_j + cols] += h[:, rows, j * R : (j + 1) * R].sum(0) B_j[slot] [R, N_j][:, cols] for one
    token tile and one column tile of output j, one dot per slot among the tile's rows and BLOCK_R of R; slot -1
    rows and rows past T untouched. The column tiles run over the layer's outputs in turn: [0, tiles(N0)) are output 0's, the next
    tiles(N1) output 1's, the rest output 2's (an output the layer lacks has N_j = 0: no tiles)."""
    c = tl.program_id(1)
    tiles0: tl.constexpr = (N0 + BLOCK_N - 1) // BLOCK_N
    tiles01: tl.constexpr = tiles0 + (N1 + BLOCK_N - 1) // BLOCK_N
    j = tl.where(c < tiles0, 0, tl.where(c < tiles01, 1, 2))
    b_ptr, n, offset = _pick(j, b0_ptr, b1_ptr, b2_ptr), _pick(j, N0, N1, N2), _pick(j, offset0, offset1, offset2)
    cols = (c - _pick(j, 0, tiles0, tiles01)) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    slots = tl.load(slots_ptr + rows, rows < num_tokens, -1)
    adapted = slots >= 0
    col_ok = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        h_mask = adapted[:, None] & r_ok[None, :]
        h_rows = h_ptr + rows[:, None] * NR + j * R + r[None, :]
        h = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for s in range(num_slices):
            h += tl.load(h_rows + s * num_tokens * NR, h_mask, 0.0)
        h = h.to(b0_ptr.dtype.element_ty)  # the torch path's shrink also rounds to the model's dtype
        left = slots  # each row's slot until its product is in acc, then -1
        slot = tl.max(left, 0)
        while slot >= 0:
            mine = left == slot
            b_rows = b_ptr + slot * R * n + r[:, None] * n
            b = tl.load(b_rows + cols[None, :], r_ok[:, None] & col_ok[None, :], 0.0)
            acc = tl.dot(tl.where(mine[:, None], h, 0.0), b, acc, input_precision=PRECISION)
            left = tl.where(mine, -1, left)
            slot = tl.max(left, 0)
    out = y_ptr + rows[:, None] * y_stride + offset + cols[None, :]
    mask = adapted[:, None] & col_ok[None, :]
    y = tl.load(out, mask, 0.0)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask)


def _dot_size(n: int) -> int:
    return min(_MAX_BLOCK_R, max(_MIN_DOT, triton.next_power_of_2(n)))


def _slicing(token_tiles: int, k: int, block_k: int) -> tuple[int, int]:
    """(slices, slice_len): the shrink's reduction cut into about _PROGRAMS / token_tiles slices of whole steps
    (fewer where K has fewer steps), none empty."""
    wanted = max(1, _PROGRAMS // token_tiles)
    slice_len = triton.cdiv(triton.cdiv(k, wanted), block_k) * block_k
    return triton.cdiv(k, slice_len), slice_len


def triton_add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bs: list[torch.Tensor],
    offsets: list[int],
    token_slots: torch.Tensor,
) -> None:
    """y [T, out] += each token's adapter product, in place; `token_slots` [T] (int64, -1: none) on y's device.
    Shapes as kernels/lora.py's add_lora, with at most 3 fused outputs; y's rows may be strided (a view), its
    columns contiguous."""
    if len(lora_bs) > _MAX_OUTPUTS:
        raise ValueError(f"{len(lora_bs)} fused outputs: the expand takes at most {_MAX_OUTPUTS}")
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    x, lora_a = x.contiguous(), lora_a.contiguous()
    bs = [b.contiguous() for b in lora_bs]
    nr, k = lora_a.shape[1], lora_a.shape[2]
    rank = bs[0].shape[1]
    block_r = _dot_size(nr)
    block_k = min(128, max(_MIN_DOT, _STEP_BYTES // (block_r * x.element_size())))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays exact: the tests compare it so
    tiles = triton.cdiv(num_tokens, _BLOCK_M)
    slices, slice_len = _slicing(tiles, k, block_k)
    h = torch.empty(slices, num_tokens, nr, dtype=torch.float32, device=x.device)
    _shrink_kernel[(tiles, slices, triton.cdiv(nr, block_r))](
        h, x, lora_a, token_slots, num_tokens, slice_len, k, nr, _BLOCK_M, block_r, block_k, precision
    )
    missing = _MAX_OUTPUTS - len(bs)  # unused pointers and sizes: the kernel never reads them
    sizes = [b.shape[2] for b in bs] + [0] * missing
    col_tiles = sum(triton.cdiv(n, _BLOCK_N) for n in sizes)
    _expand_kernel[(tiles, col_tiles)](
        y,
        h,
        *bs,
        *bs[:1] * missing,
        token_slots,
        num_tokens,
        slices,
        y.stride(0),
        *offsets,
        *[0] * missing,
        *sizes,
        rank,
        nr,
        _BLOCK_M,
        _dot_size(rank),
        _BLOCK_N,
        precision,
    )
