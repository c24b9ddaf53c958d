"""This rank's share of the KV cache: one preallocated tensor, viewed per layer."""

from __future__ import annotations

import torch


class CacheEngine:
    """Holds ``[2, num_layers, num_blocks, block_size, kv_heads_per_rank, head_dim]``.

    One tensor rather than one per layer so that the memory is claimed once
    (and counted once when sizing the cache); each attention layer gets the
    view ``kv_cache[:, layer]``. Block 0 is the scheduler's null block: it is
    allocated here but never written through a real slot.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                                    dtype=dtype, device=device)

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def bind(self, attention_layers: list) -> None:
        if len(attention_layers) != self.kv_cache.shape[1]:
            raise ValueError(f"model has {len(attention_layers)} attention layers, cache has {self.kv_cache.shape[1]}")
        for i, layer in enumerate(attention_layers):
            layer.kv_cache = self.kv_cache[:, i]
