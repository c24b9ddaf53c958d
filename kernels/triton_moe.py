"""A grouped matmul for the experts on CUDA: rows grouped by expert, each group times its own weight.

The tests run it on CPU tensors under TRITON_INTERPRET=1 against torch's `grouped_mm` (the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS, _COLS, _DEPTH = 32, 64, 32  # tile of output rows x output columns, and the reduction step; tl.dot needs >= 16


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_mm_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    tile_group_ptr,
    tile_row_ptr,
    group_end_ptr,
    num_rows,
    N: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DEPTH: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: output rows [row, min(row + ROWS, end of its group)) x columns [c * COLS, (c + 1) * COLS) of
    x @ w[group]^T, where x is [num_rows, K] and w is [groups, N, K] contiguous. A tile never spans two groups."""
    tile = tl.program_id(0)
    group = tl.load(tile_group_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    end = tl.load(group_end_ptr + group)
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    row_ok, col_ok = rows < end, cols < N
    acc = tl.zeros([ROWS, COLS], tl.float32)
    w_base = w_ptr + group.to(tl.int64) * N * K
    for k0 in range(0, K, DEPTH):
        depth = k0 + tl.arange(0, DEPTH)
        depth_ok = depth < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + depth[None, :], row_ok[:, None] & depth_ok[None, :], 0.0)
        w = tl.load(w_base + cols[None, :] * K + depth[:, None], col_ok[None, :] & depth_ok[:, None], 0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows grouped: group g is rows offs[g-1]:offs[g]) times w [G, N, K] transposed per group -> [M, N];
    `torch.nn.functional.grouped_mm(x, w.transpose(1, 2), offs=offs)`. An empty group costs no program: tiles
    are laid out over the groups' rows only."""
    x, w = x.contiguous(), w.contiguous()
    num_rows, k = x.shape
    n = w.shape[1]
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    tiles_per_group = (counts + _ROWS - 1) // _ROWS
    tile_group = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), tiles_per_group)
    first_tile = torch.cumsum(tiles_per_group, 0) - tiles_per_group
    starts = offs.long() - counts
    tile_row = starts[tile_group] + (torch.arange(tile_group.numel(), device=x.device) - first_tile[tile_group]) * _ROWS
    out = x.new_empty(num_rows, n)
    if tile_group.numel():
        _grouped_mm_kernel[(tile_group.numel(), triton.cdiv(n, _COLS))](
            out,
            x,
            w,
            tile_group.to(torch.int32),
            tile_row.to(torch.int32),
            offs.to(torch.int32),
            num_rows,
            N=n,
            K=k,
            ROWS=_ROWS,
            COLS=_COLS,
            DEPTH=_DEPTH,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )
    return out
