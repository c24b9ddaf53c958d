"""The experts' SwiGLU products on CUDA with no host read: pairs sorted and tiles laid out on the device, then a
grouped matmul launched over a grid whose size depends only on shapes, so a CUDA graph captures the op (a MoE
decode replays one like a dense one; never run on a GPU yet).

out = fused_moe(x, w13, w2, topk_weights, topk_ids, first_expert)   # as kernels.moe.fused_moe

The tests run it on CPU tensors under TRITON_INTERPRET=1 against the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.fused import silu_and_mul

_ROWS, _COLS, _DEPTH = 32, 64, 32  # tile of output rows x output columns, and the reduction step; tl.dot needs >= 16


@dataclass(slots=True)
class Tiles:
    """The T * k (token, choice) pairs sorted by local expert, and the row tiles of one grouped matmul over them.

    Every shape depends only on (T, k, num_local): `pairs` [T * k] holds flat pair indices (token * k + choice)
    in row order, local experts' groups first, then the pairs routed to other ranks' experts (one last group that
    no tile covers); `local` [T * k] says which rows are in a local group. `group_end` [num_local] int32 is the
    end row of each local group. Tile t covers rows [tile_row[t], min(tile_row[t] + ROWS, group_end[g])) of group
    g = tile_group[t]; a tile never spans two groups, and tiles past the real count have group num_local, so
    their programs return at once. `max_tiles` = min(T * k, cdiv(T * k, ROWS) + num_local) bounds the real count:
    each group adds at most one partial tile, and each tile holds at least one row."""

    pairs: Tensor
    local: Tensor
    group_end: Tensor
    tile_group: Tensor
    tile_row: Tensor


def align(topk_ids: Tensor, num_local: int, first_expert: int | None, rows: int = _ROWS) -> Tiles:
    """The pairs of `topk_ids` [T, k] sorted by local expert (experts first_expert .. first_expert + num_local - 1,
    or 0 .. num_local - 1 when `first_expert` is None) and their tiles of `rows` rows, with static-shape ops only:
    no host read, no output whose size depends on the routing."""
    expert = topk_ids.flatten()
    if first_expert is not None:
        expert = expert - first_expert
        expert = torch.where((expert >= 0) & (expert < num_local), expert, num_local)
    sorted_expert, pairs = torch.sort(expert, stable=True)
    bounds = torch.arange(num_local + 1, device=expert.device)
    group_start = torch.searchsorted(sorted_expert, bounds)  # [num_local + 1]: the last is the first foreign row
    counts = group_start[1:] - group_start[:-1]
    tiles_end = torch.cumsum((counts + rows - 1) // rows, 0)
    tiles_start = torch.cat([tiles_end.new_zeros(1), tiles_end])  # index num_local: the past-the-end tiles' start
    n = expert.numel()
    max_tiles = min(n, triton.cdiv(n, rows) + num_local)
    tile = torch.arange(max_tiles, device=expert.device)
    tile_group = torch.searchsorted(tiles_end, tile, right=True)
    tile_row = group_start.index_select(0, tile_group) + (tile - tiles_start.index_select(0, tile_group)) * rows
    return Tiles(
        pairs,
        sorted_expert < num_local,
        group_start[1:].to(torch.int32),
        tile_group.to(torch.int32),
        tile_row.to(torch.int32),
    )


@triton.jit
def _grouped_mm_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    tile_group_ptr,
    tile_row_ptr,
    group_end_ptr,
    num_groups,
    N: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DEPTH: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: output rows [row, min(row + ROWS, end of its group)) x columns [c * COLS, (c + 1) * COLS) of
    x @ w[group]^T, where x is [rows, K] and w is [num_groups, N, K] contiguous. A tile of group num_groups (past
    the real tiles) does nothing."""
    tile = tl.program_id(0)
    group = tl.load(tile_group_ptr + tile)
    if group >= num_groups:
        return
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


def grouped_mm(x: Tensor, w: Tensor, tiles: Tiles) -> Tensor:
    """x [M, K] (rows grouped as `tiles` says) times w [G, N, K] transposed per group -> [M, N], over the fixed
    grid (max_tiles, cdiv(N, COLS)). Rows no tile covers (other ranks' pairs) are left unwritten."""
    x, w = x.contiguous(), w.contiguous()
    num_rows, k = x.shape
    n = w.shape[1]
    out = x.new_empty(num_rows, n)
    if tiles.tile_group.numel():
        _grouped_mm_kernel[(tiles.tile_group.numel(), triton.cdiv(n, _COLS))](
            out,
            x,
            w,
            tiles.tile_group,
            tiles.tile_row,
            tiles.group_end,
            w.shape[0],
            N=n,
            K=k,
            ROWS=_ROWS,
            COLS=_COLS,
            DEPTH=_DEPTH,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )
    return out


def fused_moe(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, first_expert: int | None = None
) -> Tensor:
    """kernels.moe.fused_moe's sum with every buffer sized by T * top_k pairs, other ranks' pairs included: their
    rows go through the products unwritten and are masked out (not multiplied: garbage times 0 may be NaN)
    before the sum."""
    tiles = align(topk_ids, w13.shape[0], first_expert)
    tokens = tiles.pairs // topk_ids.shape[1]
    h = grouped_mm(x.index_select(0, tokens), w13, tiles)
    y = grouped_mm(silu_and_mul(h), w2, tiles)
    weights = topk_weights.flatten().index_select(0, tiles.pairs).to(y.dtype).unsqueeze(1)
    y = torch.where(tiles.local.unsqueeze(1), y * weights, 0)
    return torch.zeros_like(x).index_add_(0, tokens, y)
