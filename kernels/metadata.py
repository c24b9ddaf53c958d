"""One step's attention metadata and the interface every attention backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class AttentionBackend(Protocol):
    """Attention and KV-store ops for one device.

    `plan` runs once per step (inside `AttentionMetadata.build`) and may derive anything every
    layer needs; `store_kv` and `paged_attention` run once per layer and only read that plan.
    `kv_cache` is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = keys, 1 = values),
    each half contiguous; the block size is read from it, never configured separately.
    `window` (sliding-window attention, per layer): a query sees only its last `window` positions,
    itself included, as Hugging Face's sliding-window mask does; None: its whole context.
    `graph_capturable`: a decode step's `plan`, `store_kv` and `paged_attention` read only device
    tensors and make no host sync, so a CUDA graph captured once replays them on new inputs.
    An FP8 cache (float8_e4m3fn, `--kv-cache-dtype fp8`) holds keys / `k_scale` and values / `v_scale`,
    saturated at FP8's largest value (448), and is read back times the scales; a cache of any other dtype
    holds the values as they are and ignores the scales. A backend not in engine.config.choices'
    FP8_KV_BACKENDS reads no FP8 cache.
    """

    name: str
    graph_capturable: bool

    def plan(self, md: AttentionMetadata) -> Any: ...

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None: ...

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of one step's batch, shared by every layer.

    Invariants, for B requests and T tokens: `query_start_loc` is int32 [B+1], rising from 0 to T,
    and request b owns token rows qsl[b]:qsl[b+1] (at least one); `seq_lens` is int32 [B] with
    seq_lens[b] >= that request's query count, its queries being the last positions of its
    context; `block_tables` is int32 [B, max_blocks] holding cdiv(seq_lens[b], block_size) real
    block ids per row, then zeros (block 0 is the null block); `slot_mapping` is int64 [T];
    `max_query_len` and `max_seq_len` are the python-int maxima of those lengths; `plan` is what
    `backend.plan` derived from the rest, read only by that backend.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    plan: Any = None

    @classmethod
    def build(
        cls,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
        backend: AttentionBackend,
    ) -> AttentionMetadata:
        md = cls(query_start_loc, seq_lens, block_tables, slot_mapping, max_query_len, max_seq_len)
        md.plan = backend.plan(md)
        return md
