"""Random paged batches and a naive dense-attention reference for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from kernels import AttentionBackend, AttentionMetadata

# Every cache element no request owns holds this: a leak of it shows up as a huge error. It stays
# finite because the torch path reads (and masks) the unowned tail of gathered blocks.
POISON = 1.0e4


@dataclass(slots=True)
class Batch:
    """One step: q [T, heads, head_dim], a KV cache layer whose owned slots hold random keys and
    values (all others POISON), and the metadata tensors addressing it."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def metadata(self, backend: AttentionBackend) -> AttentionMetadata:
        q_lens = self.query_start_loc.diff()
        return AttentionMetadata.build(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            backend=backend,
        )


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Blocks are shuffled over a cache with spare blocks; tables have a spare zero column."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), POISON)
    flat = kv_cache.view(2, -1, kv_heads, head_dim)
    slots = []
    for b, (n, q_len, seq_len) in enumerate(zip(blocks_per_req, q_lens, seq_lens, strict=True)):
        tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        owned = [slot_of(tables[b], p, block_size) for p in range(seq_len)]
        flat[:, owned] = torch.randn(2, seq_len, kv_heads, head_dim, generator=gen)
        slots += owned[seq_len - q_len :]
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen)
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return Batch(
        q=q.to(dtype),
        kv_cache=kv_cache.to(dtype),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def to_fp8(batch: Batch, k_scale: float, v_scale: float) -> tuple[Batch, Batch]:
    """(`batch` with its cache in float8_e4m3fn as an FP8 KV cache stores it: keys / k_scale and values / v_scale,
    saturated; the same batch with that cache dequantized back in the queries' dtype, its exact reference)."""
    scales = torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    fp8 = (batch.kv_cache.float() / scales).clamp(-448, 448).to(torch.float8_e4m3fn)
    return replace(batch, kv_cache=fp8), replace(batch, kv_cache=(fp8.float() * scales).to(batch.q.dtype))


def slot_of(table: torch.Tensor, position: int, block_size: int) -> int:
    return int(table[position // block_size]) * block_size + position % block_size


def naive_attention(batch: Batch, scale: float, window: int | None = None) -> torch.Tensor:
    """Token by token in float64: query i of request b sees its positions 0..seq_len - q_len + i (only the last
    `window` of them when given)."""
    q, kv = batch.q.double(), batch.kv_cache.double()
    _, _, block_size, kv_heads, head_dim = kv.shape
    flat = kv.view(2, -1, kv_heads, head_dim)
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        slots = [slot_of(batch.block_tables[b], p, block_size) for p in range(seq_len)]
        keys, values = (flat[i, slots].repeat_interleave(group, dim=1) for i in (0, 1))
        for i in range(q_len):
            end = seq_len - q_len + i + 1
            first = 0 if window is None else max(0, end - window)
            scores = torch.einsum("hd,shd->hs", q[starts[b] + i], keys[first:end]) * scale
            out[starts[b] + i] = torch.einsum("hs,shd->hd", scores.softmax(-1), values[first:end])
    return out.to(batch.q.dtype)
