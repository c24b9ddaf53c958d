"""flash-attn 2 on CUDA: paged attention through its block-table kernels.

flash-attn has no KV-store op and pages only some caches, so the backend wraps a fallback (the
Triton one in production) that stores KV always and attends whenever flash-attn cannot.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionBackend, AttentionMetadata

# flash-attn 2's documented limits for paged KV (flash_attn_with_kvcache; varlen_fwd checks the same).
PAGE_BLOCK_MULTIPLE = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


# The flash-attn 2 releases whose paged calls raylm was reviewed against. Later builds add a host sync to the
# paged decode path, which breaks CUDA-graph capture (the runner then decodes eagerly) and costs every step.
SUPPORTED_VERSIONS = ((2, 6, 0), (2, 8, 3))


def version_supported(version: str) -> bool:
    """Whether a flash_attn `__version__` ("2.8.3", "2.7.4.post1", ...) is within SUPPORTED_VERSIONS."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            return False
        parts.append(int(digits))
    low, high = SUPPORTED_VERSIONS
    return low <= tuple(parts) <= high


def load_flash_attn() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """(flash_attn_varlen_func, flash_attn_with_kvcache), or None when flash_attn does not import or is a
    version outside SUPPORTED_VERSIONS (with a warning naming it)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except (ImportError, OSError):  # OSError: a wheel built against another torch or CUDA
        return None
    version = getattr(flash_attn, "__version__", "unknown")
    if not version_supported(version):
        low, high = (".".join(map(str, v)) for v in SUPPORTED_VERSIONS)
        warnings.warn(
            f"flash_attn {version} is outside the versions raylm supports ({low} to {high}); not used", stacklevel=2
        )
        return None
    return flash_attn_varlen_func, flash_attn_with_kvcache


def unusable_reason(block_size: int, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str | None:
    """Why flash-attn cannot page this KV cache, or None when it can; properties not given pass."""
    if block_size % PAGE_BLOCK_MULTIPLE:
        return f"flash-attn pages KV in blocks of a multiple of {PAGE_BLOCK_MULTIPLE} tokens, got {block_size}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"flash-attn supports float16 and bfloat16 only, got {dtype}"
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"flash-attn supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
    return None


@dataclass(slots=True)
class FlashAttnPlan:
    """`cu_seqlens_k` int32 [B+1]: cumulative seq_lens from 0, which flash_attn_varlen_func reads as
    each request's key count when k and v are paged; `fallback` is the fallback backend's plan."""

    cu_seqlens_k: torch.Tensor
    fallback: Any


class FlashAttnBackend:
    """Paged attention by flash-attn: decode-only steps through `flash_attn_with_kvcache`, the rest
    through `flash_attn_varlen_func`, both with causal=True (aligned bottom-right, as raylm's
    queries are the last positions of each context) and the block tables as they are.

    Invariant: every call flash-attn cannot serve (see `unusable_reason`) goes to `fallback`, with
    one warning naming the reason; `store_kv` always does.
    """

    name = "flash_attn"
    graph_capturable = True  # decodes go through flash_attn_with_kvcache, which reads lengths on the device

    def __init__(
        self,
        varlen_func: Callable[..., torch.Tensor],
        kvcache_func: Callable[..., torch.Tensor],
        fallback: AttentionBackend,
    ):
        self.varlen_func, self.kvcache_func, self.fallback = varlen_func, kvcache_func, fallback

    def plan(self, md: AttentionMetadata) -> FlashAttnPlan:
        return FlashAttnPlan(
            cu_seqlens_k=F.pad(md.seq_lens.cumsum(0, dtype=torch.int32), (1, 0)), fallback=self.fallback.plan(md)
        )

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        self.fallback.store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

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
        """The scales reach the fallback only: flash-attn itself never pages an FP8 cache (unusable_reason)."""
        # flash-attn's window counts keys left of the query, the query itself not included: (-1, -1) is none.
        window_size = (-1, -1) if window is None else (window - 1, 0)
        reason = unusable_reason(kv_cache.shape[2], kv_cache.dtype, kv_cache.shape[-1])
        if reason is not None:
            # The default warnings filter shows this once per process, not once per layer.
            warnings.warn(f"flash_attn cannot serve this KV cache ({reason}); using {self.fallback.name}", stacklevel=2)
            return self.fallback.paged_attention(
                q, kv_cache, dataclasses.replace(md, plan=md.plan.fallback), scale, window, k_scale, v_scale
            )
        if md.max_query_len == 1:
            out = self.kvcache_func(
                q.unsqueeze(1),
                kv_cache[0],
                kv_cache[1],
                cache_seqlens=md.seq_lens,
                block_table=md.block_tables,
                softmax_scale=scale,
                causal=True,
                window_size=window_size,
            )
            return out.squeeze(1)
        return self.varlen_func(
            q,
            kv_cache[0],
            kv_cache[1],
            md.query_start_loc,
            md.plan.cu_seqlens_k,
            md.max_query_len,
            md.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window_size,
            block_table=md.block_tables,
        )
