"""Triton kernels for CUDA: KV store by slot, and paged attention over block tables with GQA.

The tests run them on CPU tensors under TRITON_INTERPRET=1, which triton reads when `@triton.jit`
decorates, i.e. when this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata

# Query rows per program for prefill tiles, and keys per inner step; tl.dot needs each >= 16.
_PREFILL_ROWS = 64
_MIN_ROWS = 16
_KEYS_PER_STEP = 32


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    ok = (h < KV_HEADS) & (d < HEAD_DIM)
    dst = slot * stride_slot + h * stride_head + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=ok), mask=ok)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=ok), mask=ok)


# The table's row stride is its width, which changes with the longest context: specialised on (as Triton does
# for ints divisible by 16), the first step whose width was a multiple of 16 would compile again mid-serving.
@triton.jit(do_not_specialize=["stride_table"])
def _paged_attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                            query_start_loc_ptr, scale,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_block, stride_slot, stride_head, stride_table,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, ROWS: tl.constexpr,
                            KEYS: tl.constexpr, PRECISION: tl.constexpr):
    """One program: up to TOKENS_PER_TILE query tokens of one request times the GROUP query heads
    that share one KV head (row r = token r // GROUP, head r % GROUP), against that KV head."""
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
        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = seq_len - q_len + token
        # Keys past the tile's last query position are masked for every row, so never loaded.
        kv_end = tl.minimum(seq_len, seq_len - q_len + tile_start + TOKENS_PER_TILE)
        qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp2 is cheaper than exp
        m = tl.full([ROWS], float("-inf"), tl.float32)
        denom = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        for start in range(0, kv_end, KEYS):
            pos = start + tl.arange(0, KEYS)
            pos_ok = pos < kv_end
            block = tl.load(block_tables_ptr + req * stride_table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            offset = block.to(tl.int64) * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
            kv_ok = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + offset[:, None] + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_cache_ptr + offset[:, None] + d[None, :], mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            # Key 0 is visible to every row, so each row's running max is finite after the first step.
            s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / denom[:, None]
        tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


class TritonBackend:
    """Paged attention and KV store as Triton kernels; reads the metadata tensors as they are.

    Needs no per-step plan and holds no state. Slots, block ids and lengths must be valid: the
    kernels trust them (no bounds checks on the device).
    """

    name = "triton"
    graph_capturable = True

    def plan(self, md: AttentionMetadata) -> None:
        return None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        _, _, _, kv_heads, head_dim = kv_cache.shape
        k_cache, v_cache = (kv_cache[i].view(-1, kv_heads, head_dim) for i in (0, 1))
        _store_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
            KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        )

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        _, _, block_size, kv_heads, head_dim = kv_cache.shape
        group = q.shape[1] // kv_heads
        # A decode-only step needs one token per tile; bigger tiles would only hold masked rows.
        rows = max(_MIN_ROWS, triton.next_power_of_2(group)) if md.max_query_len == 1 \
            else max(_PREFILL_ROWS, triton.next_power_of_2(group))
        tokens_per_tile = rows // group
        out = q.new_empty(q.shape)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        grid = (md.seq_lens.shape[0], triton.cdiv(md.max_query_len, tokens_per_tile), kv_heads)
        _paged_attention_kernel[grid](
            out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), md.block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SIZE=block_size, TOKENS_PER_TILE=tokens_per_tile, ROWS=rows, KEYS=_KEYS_PER_STEP,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        return out
