"""The experts' SwiGLU products on CUDA with no host read: pairs sorted and tiles laid out on the device, then a
grouped matmul launched over a grid whose size depends only on shapes, so a CUDA graph captures the op (a MoE
decode replays one like a dense one; never run on a GPU yet).

out = fused_moe(x, w13, w2, topk_weights, topk_ids, first_expert)   # as kernels.moe.fused_moe

A decode's op is five launches, whatever the expert count: one program sorts the pairs and lays out the tiles
(vLLM's moe_align_block_size idea), the first product reads each pair's token where it is, the SiLU, the second
product writes each pair's row times its routing weight at the pair's place in [T, k], and a sum over k. A MoE
layer's graph nodes are what a decode step pays on a GPU when its bytes are few: eight of Qwen3-30B-A3B's
layers at one token read about 0.25 ms of weights.

The tile sizes come from a table per expert shape, GPU and dtype measured on that GPU (`raylm bench moe --tune`
writes it into kernels/moe_configs/, as vLLM's fused_moe configs are), by the step's pair count; a shape with no
table takes TileConfig's defaults. The tests run it on CPU tensors under TRITON_INTERPRET=1 against the torch path.

FP8 experts (float8_e4m3fn weights with float32 scales per expert and output row, or per tile of each expert's
matrix: workers/models/moe.py's `to_fp8`) run W8A8: each product's input quantized per token (per group of a
tile's columns with tiles) by kernels/fp8.py, then tl.dot of FP8 tiles summed in fp32 and multiplied by both
scales, as kernels/triton_fp8.py's block product does. Their tables are those of dtype float8_e4m3fn, and of
their tile where the scales are per tile (`raylm bench moe --tune --fp8-block 128 128`). A static checkpoint's
experts quantize each product's input with its one fixed scale instead (row-wise weights; the scale repeated over
the rows).
Checked under the interpreter only, like the rest: untested on a GPU.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.formats import block_step, block_unsupported
from kernels.fp8 import quantize_per_tensor, quantize_per_token, round_per_tensor
from kernels.fused import silu_and_mul

# Where the measured tables live; RAYLM_MOE_CONFIG_DIR names another folder (a tuning run's output, tests).
CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One launch's tiles: output rows x output columns and the reduction step (each >= 16, as tl.dot needs; rows
    also sets the alignment of the experts' groups), and Triton's warps and pipeline stages. The defaults are what
    ran before any table was measured."""

    rows: int = 32
    cols: int = 64
    depth: int = 32
    num_warps: int = 4
    num_stages: int = 2


def config_name(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    device: str,
    block: tuple[int, int] | None = None,
) -> str:
    """The table's file name for an expert shape (E local experts of `intermediate_size` units on `hidden_size`),
    weights' dtype and, for FP8 experts with tile scales, their tile: the reduction's step is the tile's there."""
    gpu = device.replace(" ", "_").replace("/", "_")
    tile = "" if block is None else f",block={block[0]}x{block[1]}"
    return (
        f"E={num_experts},H={hidden_size},I={intermediate_size},device={gpu},"
        f"dtype={str(dtype).removeprefix('torch.')}{tile}.json"
    )


@functools.cache
def _table(name: str) -> tuple[tuple[int, TileConfig], ...]:
    """A table's (pair count, config) rows, ascending; empty where none was measured. A malformed table is an error
    naming its file, never silently the defaults."""
    path = Path(os.environ.get("RAYLM_MOE_CONFIG_DIR") or CONFIG_DIR) / name
    if not path.is_file():
        return ()
    try:
        rows = sorted((int(m), TileConfig(**c)) for m, c in json.loads(path.read_text()).items())
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a table of pair count -> {TileConfig.__name__} fields ({e})") from None
    return tuple(rows)


def tile_config(num_pairs: int, w13: Tensor, block: tuple[int, int] | None = None) -> TileConfig:
    """The measured config whose pair count is nearest `num_pairs` (T * top_k) for these experts (FP8 ones of
    `block` tiles) on this GPU, else the defaults. Depends on shapes only, so a captured graph keeps its launch."""
    device = _device_name(w13.device.index if w13.is_cuda else None)
    num_experts, two_i, hidden = w13.shape
    table = _table(config_name(num_experts, hidden, two_i // 2, w13.dtype, device, block))
    if not table:
        return TileConfig()
    return min(table, key=lambda row: (abs(row[0] - num_pairs), row[0]))[1]


@functools.cache
def _device_name(cuda_index: int | None) -> str:
    return "cpu" if cuda_index is None else torch.cuda.get_device_name(cuda_index)


def write_table(path: Path, table: dict[int, TileConfig]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(m): asdict(c) for m, c in sorted(table.items())}, indent=1) + "\n")


# Pairs (T * top_k) up to which one program sorts them and lays out their tiles: every decode a captured graph
# replays (512 tokens of top-8). A larger step, a prefill chunk, sorts with torch's ops: its products outweigh
# a few more launches, and one program's bitonic sort would grow with it.
MAX_ONE_PROGRAM_PAIRS = 4096
# Tiles laid out per iteration of the one program's loop, each against every group: [TILE_CHUNK, groups] values.
TILE_CHUNK = 32


@dataclass(slots=True)
class Tiles:
    """The T * k (token, choice) pairs sorted by local expert, and the row tiles of one grouped matmul over them.

    Every shape depends only on (T, k, num_local): `pairs` [T * k] int32 holds flat pair indices (token * k +
    choice) in row order, local experts' groups first, then the pairs routed to other ranks' experts (one last
    group that no tile covers). `group_end` [num_local] int32 is the end row of each local group. Tile t covers
    rows [tile_row[t], min(tile_row[t] + ROWS, group_end[g])) of group g = tile_group[t]; a tile never spans two
    groups, and tiles past the real count have group num_local, so their programs return at once (their rows
    mean nothing). `max_tiles` = min(T * k, cdiv(T * k, ROWS) + num_local) bounds the real count: each group adds
    at most one partial tile, and each tile holds at least one row."""

    pairs: Tensor
    group_end: Tensor
    tile_group: Tensor
    tile_row: Tensor


def align(topk_ids: Tensor, num_local: int, first_expert: int | None, rows: int = TileConfig().rows) -> Tiles:
    """The pairs of `topk_ids` [T, k] sorted by local expert (experts first_expert .. first_expert + num_local - 1,
    or 0 .. num_local - 1 when `first_expert` is None), stably, and their tiles of `rows` rows: no host read, no
    output whose size depends on the routing. One Triton program up to MAX_ONE_PROGRAM_PAIRS pairs (a decode's
    graph then launches one kernel where torch's sort, searches and index arithmetic launch about 20), torch's
    ops above."""
    n = topk_ids.numel()
    max_tiles = min(n, triton.cdiv(n, rows) + num_local)
    if 0 < n <= MAX_ONE_PROGRAM_PAIRS:
        return _align_one_program(topk_ids, num_local, first_expert, rows, max_tiles)
    return _align_sorting(topk_ids, num_local, first_expert, rows, max_tiles)


def _align_sorting(topk_ids: Tensor, num_local: int, first_expert: int | None, rows: int, max_tiles: int) -> Tiles:
    expert = topk_ids.flatten() - (first_expert or 0)
    expert = torch.where((expert >= 0) & (expert < num_local), expert, num_local)
    sorted_expert, pairs = torch.sort(expert, stable=True)
    bounds = torch.arange(num_local + 1, device=expert.device)
    group_start = torch.searchsorted(sorted_expert, bounds)  # [num_local + 1]: the last is the first foreign row
    counts = group_start[1:] - group_start[:-1]
    tiles_end = torch.cumsum((counts + rows - 1) // rows, 0)
    tiles_start = torch.cat([tiles_end.new_zeros(1), tiles_end])  # index num_local: the past-the-end tiles' start
    tile = torch.arange(max_tiles, device=expert.device)
    tile_group = torch.searchsorted(tiles_end, tile, right=True)
    tile_row = group_start.index_select(0, tile_group) + (tile - tiles_start.index_select(0, tile_group)) * rows
    i32 = torch.int32
    return Tiles(pairs.to(i32), group_start[1:].to(i32), tile_group.to(i32), tile_row.to(i32))


def _align_one_program(topk_ids: Tensor, num_local: int, first_expert: int | None, rows: int, max_tiles: int) -> Tiles:
    n, device = topk_ids.numel(), topk_ids.device
    tiles = Tiles(
        torch.empty(n, dtype=torch.int32, device=device),
        torch.empty(num_local, dtype=torch.int32, device=device),
        torch.empty(max_tiles, dtype=torch.int32, device=device),
        torch.empty(max_tiles, dtype=torch.int32, device=device),
    )
    pairs = max(16, triton.next_power_of_2(n))  # a decode of one token's few pairs: no degenerate sort or layout
    _align_kernel[(1,)](
        topk_ids.contiguous(),
        tiles.pairs,
        tiles.group_end,
        tiles.tile_group,
        tiles.tile_row,
        n,
        num_local,
        first_expert or 0,
        max_tiles,
        PAIRS=pairs,
        # Two groups past the local ones: the other ranks' pairs, then the padding past n (a bin it can count in).
        GROUPS=triton.next_power_of_2(num_local + 2),
        ROWS=rows,
        TILE_CHUNK=TILE_CHUNK,
        num_warps=8 if pairs >= 1024 else 4,
    )
    return tiles


@triton.jit
def _align_kernel(
    topk_ids_ptr,
    pairs_ptr,
    group_end_ptr,
    tile_group_ptr,
    tile_row_ptr,
    n,
    num_local,
    first_expert,
    max_tiles,
    PAIRS: tl.constexpr,
    GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    TILE_CHUNK: tl.constexpr,
):
    """The whole of `align` in one program: each pair's group (its local expert; num_local for another rank's; the
    last group for the padding past n) and index make one key, whose sort orders the pairs by group and, within
    one, by index (a stable sort); a histogram of the groups gives their starts and ends, and each tile its group
    and first row by comparing it with every group's tiles."""
    i = tl.arange(0, PAIRS)
    valid = i < n
    group = tl.load(topk_ids_ptr + i, valid, 0).to(tl.int32) - first_expert
    group = tl.where((group >= 0) & (group < num_local), group, num_local)
    group = tl.where(valid, group, GROUPS - 1)
    ordered = tl.sort(group * PAIRS + i)
    tl.store(pairs_ptr + i, ordered % PAIRS, valid)

    counts = tl.histogram(group, GROUPS)
    g = tl.arange(0, GROUPS)
    group_start = tl.cumsum(counts, 0) - counts
    local = g < num_local
    tl.store(group_end_ptr + g, group_start + counts, local)
    group_tiles = tl.where(local, (counts + ROWS - 1) // ROWS, 0)
    tiles_end = tl.cumsum(group_tiles, 0)
    tiles_start = tiles_end - group_tiles
    for t0 in range(0, max_tiles, TILE_CHUNK):
        t = t0 + tl.arange(0, TILE_CHUNK)
        # Past the last real tile every local group has ended: group num_local, which the products skip.
        ended = (tiles_end[None, :] <= t[:, None]) & local[None, :]
        inside = (tiles_start[None, :] <= t[:, None]) & (t[:, None] < tiles_end[None, :])
        first_row = group_start[None, :] + (t[:, None] - tiles_start[None, :]) * ROWS
        t_ok = t < max_tiles
        tl.store(tile_group_ptr + t, tl.sum(ended.to(tl.int32), 1), t_ok)
        tl.store(tile_row_ptr + t, tl.sum(tl.where(inside, first_row, 0), 1), t_ok)


@triton.jit
def _grouped_mm_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    x_scale_ptr,
    w_scale_ptr,
    pairs_ptr,
    pair_weights_ptr,
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
    SCALES: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
    GATHER_TOP_K: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """One program: output rows [row, min(row + ROWS, end of its group)) x columns [c * COLS, (c + 1) * COLS) of
    x @ w[group]^T, where w is [num_groups, N, K] contiguous. A tile of group num_groups (past the real tiles)
    does nothing. Row r's input is x's row r, or with GATHER_TOP_K its pair's token's, pairs[r] // GATHER_TOP_K
    (x is then the tokens [T, K], not a copy per pair). Its output goes to out's row r, or with SCATTER to its
    pair's row pairs[r], times the pair's routing weight (fp32 [T * k]).

    SCALES says what x and w are: "none", plain ones; "rows", FP8 with x_scale [x's rows, 1] and w_scale
    [num_groups, N] (the fp32 sum of the FP8 products, times both scales once); "tiles", FP8 with x_scale
    [x's rows, cdiv(K, TILE_COLS)] and w_scale [num_groups, cdiv(N, TILE_ROWS), cdiv(K, TILE_COLS)] (each step's
    sum times its two scales, as kernels/triton_fp8.py's block product: DEPTH divides TILE_COLS, so a step
    never straddles two tiles)."""
    tile = tl.program_id(0)
    group = tl.load(tile_group_ptr + tile)
    if group >= num_groups:
        return
    row0 = tl.load(tile_row_ptr + tile)
    end = tl.load(group_end_ptr + group)
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    row_ok, col_ok = rows < end, cols < N
    out_rows, x_rows = rows, rows
    if GATHER_TOP_K > 0 or SCATTER:
        pair = tl.load(pairs_ptr + rows, row_ok, 0)
        if GATHER_TOP_K > 0:
            x_rows = pair // GATHER_TOP_K
        if SCATTER:
            out_rows = pair
    acc = tl.zeros([ROWS, COLS], tl.float32)
    w_base = w_ptr + group.to(tl.int64) * N * K
    k_tiles: tl.constexpr = (K + TILE_COLS - 1) // TILE_COLS
    n_tiles: tl.constexpr = (N + TILE_ROWS - 1) // TILE_ROWS
    w_scale_tiles = w_scale_ptr + group.to(tl.int64) * n_tiles * k_tiles + (cols // TILE_ROWS) * k_tiles
    for k0 in range(0, K, DEPTH):
        depth = k0 + tl.arange(0, DEPTH)
        depth_ok = depth < K
        x = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * K + depth[None, :], row_ok[:, None] & depth_ok[None, :], 0.0)
        w = tl.load(w_base + cols[None, :] * K + depth[:, None], col_ok[None, :] & depth_ok[:, None], 0.0)
        if SCALES == "tiles":
            x_scale = tl.load(x_scale_ptr + x_rows.to(tl.int64) * k_tiles + k0 // TILE_COLS, row_ok, 0.0)
            w_scale = tl.load(w_scale_tiles + k0 // TILE_COLS, col_ok, 0.0)
            acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
        elif SCALES == "rows":
            acc = tl.dot(x, w, acc)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if SCALES == "rows":
        x_scale = tl.load(x_scale_ptr + x_rows, row_ok, 0.0)
        w_scale = tl.load(w_scale_ptr + group.to(tl.int64) * N + cols, col_ok, 0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
    if SCATTER:
        acc = acc * tl.load(pair_weights_ptr + out_rows, row_ok, 0.0)[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + out_rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask)


def grouped_mm(
    x: Tensor,
    w: Tensor,
    tiles: Tiles,
    config: TileConfig = TileConfig(),
    w_scale: Tensor | None = None,
    block: tuple[int, int] | None = None,
    gather_top_k: int = 0,
    pair_weights: Tensor | None = None,
    out: Tensor | None = None,
    input_scale: Tensor | None = None,
) -> Tensor:
    """x's rows (grouped as `tiles` says, in tiles of config.rows) times w [G, N, K] transposed per group -> [M, N]
    in x's dtype, M = tiles.pairs' count, over the fixed grid (max_tiles, cdiv(N, config.cols)). x is [M, K] in
    row order, or with `gather_top_k` k the tokens [M / k, K], each row reading its pair's token. With
    `pair_weights` (fp32 [M], by pair) row r's output lands on row tiles.pairs[r], times its pair's weight. Rows
    no tile covers (other ranks' pairs) are left as `out` (default: a new [M, N] buffer) holds them.

    With `w_scale`, w is float8_e4m3fn and x is quantized per token (kernels/fp8.py), W8A8: w_scale float32
    [G, N], one per (group, output row), with x's rows quantized whole; or, with `block` (rows, cols), one per
    tile [G, ceil(N / rows), ceil(K / cols)], with x's rows quantized per group of `cols` columns and the
    reduction stepping by a power of two that divides `cols` (at most config.depth); ValueError for tiles whose
    step is too short for a GPU's 8-bit dot (kernels/fp8.py `block_unsupported`). `input_scale` (0-d float32, a
    static checkpoint's; row-wise or plain weights): x quantized with that one scale rather than per token, or,
    before plain weights, rounded through FP8 at it. Shapes still depend only on x's and w's: no host read."""
    out = x.new_empty(tiles.pairs.numel(), w.shape[1]) if out is None else out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    scales, x_scale, depth, tile = "none", None, config.depth, (1, 1)
    if w_scale is None and input_scale is not None:
        x = round_per_tensor(x, input_scale)
    elif w_scale is not None and input_scale is not None:
        if block is not None:
            raise ValueError(f"a static input scale with {block[0]}x{block[1]} block scales: blocks take dynamic ones")
        scales = "rows"
        x, x_scale = quantize_per_tensor(x, input_scale)
    elif w_scale is not None:
        scales = "rows" if block is None else "tiles"
        x, x_scale = quantize_per_token(x, None if block is None else block[1])
        if block is not None:
            if why := block_unsupported(block):
                raise ValueError(why)
            depth, tile = min(depth, block_step(block[1])), block
    x, w = x.contiguous(), w.contiguous()
    n, k = w.shape[1:]
    if tiles.tile_group.numel():
        _grouped_mm_kernel[(tiles.tile_group.numel(), triton.cdiv(n, config.cols))](
            out,
            x,
            w,
            x if x_scale is None else x_scale.contiguous(),
            w if w_scale is None else w_scale.contiguous(),
            tiles.pairs,
            out if pair_weights is None else pair_weights.contiguous(),
            tiles.tile_group,
            tiles.tile_row,
            tiles.group_end,
            w.shape[0],
            N=n,
            K=k,
            ROWS=config.rows,
            COLS=config.cols,
            DEPTH=depth,
            PRECISION=precision,
            SCALES=scales,
            TILE_ROWS=tile[0],
            TILE_COLS=tile[1],
            GATHER_TOP_K=gather_top_k,
            SCATTER=pair_weights is not None,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return out


def fused_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    first_expert: int | None = None,
    config: TileConfig | None = None,
    w13_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
    block: tuple[int, int] | None = None,
    input_scales: tuple[Tensor | None, Tensor | None] = (None, None),
) -> Tensor:
    """kernels.moe.fused_moe's sum with every buffer sized by T * top_k pairs, other ranks' pairs included, in
    about five launches: the alignment, the first product reading each pair's token in place, the SiLU, the
    second product writing each pair's row times its weight where the pair stands in [T, k], and the sum over
    k. Other ranks' pairs go through the products unwritten; their rows of the second product's output start at
    zero (never garbage: garbage times a weight of 0 may be NaN). `config`: these tiles rather than the table's
    (the tuner's candidates). FP8 experts (w13, w2 float8_e4m3fn with `w13_scale`, `w2_scale`, per row or per
    `block` tile as `grouped_mm` takes them): the tokens are quantized before the first product and the SiLU's
    output before the second, per token or with `input_scales` (the first product's, the second's: a static
    checkpoint's)."""
    config = config or tile_config(topk_ids.numel(), w13, block)
    tiles = align(topk_ids, w13.shape[0], first_expert, config.rows)
    h = grouped_mm(x, w13, tiles, config, w13_scale, block, gather_top_k=topk_ids.shape[1], input_scale=input_scales[0])
    out = None if first_expert is None else x.new_zeros(topk_ids.numel(), w2.shape[1])
    weights = topk_weights.flatten().float()
    y = grouped_mm(
        silu_and_mul(h), w2, tiles, config, w2_scale, block, pair_weights=weights, out=out, input_scale=input_scales[1]
    )
    return y.view(*topk_ids.shape, w2.shape[1]).sum(1)
