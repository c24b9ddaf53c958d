"""Triton kernels for CUDA: KV store by slot, and paged attention over block tables with GQA.

An FP8 cache (float8_e4m3fn) is written as the values / their scale, saturated, and read back times the scale
into the queries' dtype before each product (a compile-time branch: other caches pay nothing for it).

The tests run them on CPU tensors under TRITON_INTERPRET=1, which triton reads when `@triton.jit`
decorates, i.e. when this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import FP8_MAX
from kernels.metadata import AttentionMetadata

# Query rows per program for prefill tiles, and keys per inner step; tl.dot needs each >= 16.
_PREFILL_ROWS = 64
_MIN_ROWS = 16
_KEYS_PER_STEP = 32
# Decode-only steps with fewer (request, KV head) programs than this split each context into partitions, one
# program each, merged by a second kernel: otherwise a few contexts would each be read by one program while most
# of the GPU's SMs idle (flash-decoding). A partition holds at least _MIN_PARTITION keys and there are at most
# _MAX_SPLITS of them: a captured graph is sized for max_model_len, and every partition past a context still
# costs its program and the merge a read, so partitions grow with the longest context past 64 x 128 keys.
# (512-key partitions left a 300-key context to one program per KV head: 15 us a layer on an H200, docs/gpu.md.)
_SPLIT_BELOW_PROGRAMS = 256
_MIN_PARTITION = 128
_MAX_SPLITS = 64
_MERGE_SPLITS_PER_STEP = 16


@triton.jit
def _fold_keys(
    q,
    m,
    denom,
    acc,
    pos,
    pos_ok,
    visible,
    table_row_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    stride_block,
    stride_slot,
    stride_head,
    d,
    d_ok,
    qk_scale,
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """The keys and values at positions `pos` (where `pos_ok`) folded into each row's running softmax (max
    `m`, sum `denom`, weighted values `acc`, base 2), scores outside `visible` [rows, keys] masked; FP8 pages are
    dequantized by `k_scale` and `v_scale` into the queries' dtype first."""
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    offset = block.to(tl.int64) * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    kv_ok = pos_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + offset[:, None] + d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_cache_ptr + offset[:, None] + d[None, :], mask=kv_ok, other=0.0)
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    s = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    stride_head,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    ok = (h < KV_HEADS) & (d < HEAD_DIM)
    dst = slot * stride_slot + h * stride_head + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=ok)
    if FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


# The table's row stride is its width, which changes with the longest context: specialised on (as Triton does
# for ints divisible by 16), the first step whose width was a multiple of 16 would compile again mid-serving.
@triton.jit(do_not_specialize=["stride_table"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    ROWS: tl.constexpr,
    KEYS: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program: up to TOKENS_PER_TILE query tokens of one request times the GROUP query heads
    that share one KV head (row r = token r // GROUP, head r % GROUP), against that KV head. With
    `window` > 0 a query sees only its last `window` positions; keys before the tile's first query's
    window are never loaded."""
    req = tl.program_id(0)
    tile_start = tl.program_id(1) * TOKENS_PER_TILE
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile_start < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        rows = tl.arange(0, ROWS)
        token = tile_start + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < TOKENS_PER_TILE * GROUP) & (token < q_len)
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        q_pos = seq_len - q_len + token
        # Keys past the tile's last query position are masked for every row, so never loaded.
        kv_end = tl.minimum(seq_len, seq_len - q_len + tile_start + TOKENS_PER_TILE)
        kv_start = tl.where(window > 0, tl.maximum(seq_len - q_len + tile_start - window + 1, 0), 0)
        qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp2 is cheaper than exp
        # A finite start: with a window, a row may see no key in the first steps (exp2(-inf - -inf) is NaN).
        m = tl.full([ROWS], -1.0e30, tl.float32)
        denom = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        for start in range(kv_start, kv_end, KEYS):
            pos = start + tl.arange(0, KEYS)
            pos_ok = pos < kv_end
            in_window = (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :] & in_window
            m, denom, acc = _fold_keys(
                q,
                m,
                denom,
                acc,
                pos,
                pos_ok,
                visible,
                block_tables_ptr + req * stride_table,
                k_cache_ptr,
                v_cache_ptr,
                kv_head,
                stride_block,
                stride_slot,
                stride_head,
                d,
                d_ok,
                qk_scale,
                k_scale,
                v_scale,
                BLOCK_SIZE,
                PRECISION,
                FP8,
            )
        out = acc / denom[:, None]
        tl.store(
            out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


# The split count changes with the longest context: as a constexpr, or specialised on (as Triton does for ints
# divisible by 16), every step whose longest context crossed a partition boundary would compile both kernels again.
@triton.jit(do_not_specialize=["stride_table", "num_splits"])
def _paged_decode_split_kernel(
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    num_splits,
    window,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    KEYS: tl.constexpr,
    PARTITION: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program: the single query of one request, its GROUP heads on one KV head, against the keys of one
    partition of its context (of its last `window` keys when `window` > 0). Writes the partition's normalised
    output and log-sum-exp (base 2); a partition with no key to read writes 0 and -inf, so the merge needs no
    length."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, ROWS)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    part = (req * NUM_HEADS + head).to(tl.int64) * num_splits + split
    seq_len = tl.load(seq_lens_ptr + req)
    start = tl.where(window > 0, tl.maximum(split * PARTITION, seq_len - window), split * PARTITION)
    if start < tl.minimum(seq_len, split * PARTITION + PARTITION):
        token = tl.load(query_start_loc_ptr + req)
        q = tl.load(
            q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        end = tl.minimum(seq_len, split * PARTITION + PARTITION)
        qk_scale = scale * 1.4426950408889634
        m = tl.full([ROWS], float("-inf"), tl.float32)
        denom = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        for key in range(start, end, KEYS):
            pos = key + tl.arange(0, KEYS)
            pos_ok = pos < end
            # The query is its context's last token: every key in [start, end) is visible, no causal cut.
            m, denom, acc = _fold_keys(
                q,
                m,
                denom,
                acc,
                pos,
                pos_ok,
                pos_ok[None, :],
                block_tables_ptr + req * stride_table,
                k_cache_ptr,
                v_cache_ptr,
                kv_head,
                stride_block,
                stride_slot,
                stride_head,
                d,
                d_ok,
                qk_scale,
                k_scale,
                v_scale,
                BLOCK_SIZE,
                PRECISION,
                FP8,
            )
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc / denom[:, None], mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, m + tl.log2(denom), mask=row_ok)
    else:
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :],
            tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32),
            mask=row_ok[:, None],
        )
        tl.store(part_lse_ptr + part, tl.full([ROWS], float("-inf"), tl.float32), mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PER_STEP: tl.constexpr,
):
    """One program: one request's head, its partitions weighted by their share of the softmax mass, read
    SPLITS_PER_STEP at a time with a running max (a 128k context's 256 partitions at once would not fit in
    registers)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM_PAD)
    base = (req * NUM_HEADS + head).to(tl.int64) * num_splits
    # A finite start: the first partitions are empty (lse -inf) when a window cut them off.
    m = tl.full([1], -1.0e30, tl.float32)
    denom = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for first in range(0, num_splits, SPLITS_PER_STEP):
        splits = first + tl.arange(0, SPLITS_PER_STEP)
        ok = splits < num_splits
        lse = tl.load(part_lse_ptr + base + splits, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        weight = tl.exp2(lse - m_new)
        alpha = tl.exp2(m - m_new)
        parts = tl.load(
            part_out_ptr + (base + splits)[:, None] * HEAD_DIM_PAD + d[None, :], mask=ok[:, None], other=0.0
        )
        denom = denom * alpha + tl.sum(weight, 0)
        acc = acc * alpha + tl.sum(parts * weight[:, None], 0)
        m = m_new
    token = tl.load(query_start_loc_ptr + req)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        (acc / denom).to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def split_plan(max_seq_len: int) -> tuple[int, int]:
    """(keys per partition, partitions) of a split decode whose longest context is `max_seq_len`. Both are powers
    of two: the partition size is a constexpr (a few compiles as contexts grow), and the count comes in a few
    sizes the caching allocator reuses for the scratch buffers (the partitions past a context cost one store
    each)."""
    partition = max(_MIN_PARTITION, triton.next_power_of_2(triton.cdiv(max_seq_len, _MAX_SPLITS)))
    return partition, triton.next_power_of_2(triton.cdiv(max_seq_len, partition))


class TritonBackend:
    """Paged attention and KV store as Triton kernels; reads the metadata tensors as they are.

    Needs no per-step plan and holds no state. Slots, block ids and lengths must be valid: the
    kernels trust them (no bounds checks on the device).
    """

    name = "triton"
    graph_capturable = True

    def plan(self, md: AttentionMetadata) -> None:
        return None

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        _, _, _, kv_heads, head_dim = kv_cache.shape
        k_cache, v_cache = (kv_cache[i].view(-1, kv_heads, head_dim) for i in (0, 1))
        _store_kv_kernel[(k.shape[0],)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k_scale,
            v_scale,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            KV_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(kv_heads),
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            FP8=kv_cache.dtype == torch.float8_e4m3fn,
            FP8_MAX=FP8_MAX,
        )

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """`window`: each query attends to its last `window` positions only (itself included), or all when None."""
        _, _, block_size, kv_heads, head_dim = kv_cache.shape
        group = q.shape[1] // kv_heads
        if md.max_query_len == 1 and md.seq_lens.shape[0] * kv_heads < _SPLIT_BELOW_PROGRAMS:
            partition, num_splits = split_plan(md.max_seq_len)
            if num_splits > 1:
                return self._split_decode(
                    q, kv_cache, md, (scale, k_scale, v_scale), partition, num_splits, window or 0
                )
        # A decode-only step needs one token per tile; bigger tiles would only hold masked rows.
        rows = (
            max(_MIN_ROWS, triton.next_power_of_2(group))
            if md.max_query_len == 1
            else max(_PREFILL_ROWS, triton.next_power_of_2(group))
        )
        tokens_per_tile = rows // group
        out = q.new_empty(q.shape)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        grid = (md.seq_lens.shape[0], triton.cdiv(md.max_query_len, tokens_per_tile), kv_heads)
        _paged_attention_kernel[grid](
            out,
            q,
            k_cache,
            v_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            scale,
            k_scale,
            v_scale,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            md.block_tables.stride(0),
            window or 0,
            GROUP=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SIZE=block_size,
            TOKENS_PER_TILE=tokens_per_tile,
            ROWS=rows,
            KEYS=_KEYS_PER_STEP,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            FP8=kv_cache.dtype == torch.float8_e4m3fn,
        )
        return out

    def _split_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scales: tuple[float, float, float],
        partition: int,
        num_splits: int,
        window: int,
    ) -> torch.Tensor:
        """`scales`: the softmax's, then the FP8 pages' k_scale and v_scale."""
        _, _, block_size, kv_heads, head_dim = kv_cache.shape
        num_reqs, num_heads = md.seq_lens.shape[0], q.shape[1]
        head_dim_pad = max(16, triton.next_power_of_2(head_dim))
        part_out = q.new_empty((num_reqs, num_heads, num_splits, head_dim_pad), dtype=torch.float32)
        part_lse = q.new_empty((num_reqs, num_heads, num_splits), dtype=torch.float32)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        group = num_heads // kv_heads
        _paged_decode_split_kernel[(num_reqs, kv_heads, num_splits)](
            part_out,
            part_lse,
            q,
            k_cache,
            v_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            *scales,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            md.block_tables.stride(0),
            num_splits,
            window,
            NUM_HEADS=num_heads,
            GROUP=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=block_size,
            ROWS=max(_MIN_ROWS, triton.next_power_of_2(group)),
            KEYS=_KEYS_PER_STEP,
            PARTITION=partition,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            FP8=kv_cache.dtype == torch.float8_e4m3fn,
        )
        out = q.new_empty(q.shape)
        _merge_splits_kernel[(num_reqs, num_heads)](
            out,
            part_out,
            part_lse,
            md.query_start_loc,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PER_STEP=_MERGE_SPLITS_PER_STEP,
        )
        return out
