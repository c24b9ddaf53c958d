"""Attention and KV-store ops behind one small interface; they see tensors only, never requests.

backend = select_backend("auto", device)
md = AttentionMetadata.build(query_start_loc=..., seq_lens=..., block_tables=..., slot_mapping=...,
                             max_query_len=..., max_seq_len=..., backend=backend)   # once per step
backend.store_kv(k, v, kv_cache_layer, md.slot_mapping)                             # per layer
out = backend.paged_attention(q, kv_cache_layer, md, scale)
"""

from __future__ import annotations

import importlib.util

import torch

from kernels.metadata import AttentionBackend, AttentionMetadata
from kernels.torch_attention import TorchBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchBackend", "default_block_size", "select_backend"]

BACKENDS = ("auto", "torch", "triton", "flash_attn")
DEFAULT_BLOCK_SIZE = 16


def default_block_size(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> int:
    """The KV block size for backend `name` on `device` when none is configured: flash-attn's smallest
    page (256 tokens) where it is named, or where "auto" would choose it (flash-attn installed and usable
    for `dtype`, the KV cache's, on CUDA); else 16, which keeps prefix-cache hits fine-grained."""
    from kernels.flash_attention import PAGE_BLOCK_MULTIPLE

    if name == "flash_attn":
        return PAGE_BLOCK_MULTIPLE
    if name != "auto" or torch.device(device).type != "cuda":
        return DEFAULT_BLOCK_SIZE
    chosen = select_backend("auto", device, PAGE_BLOCK_MULTIPLE, dtype)
    return PAGE_BLOCK_MULTIPLE if chosen.name == "flash_attn" else DEFAULT_BLOCK_SIZE


def select_backend(
    name: str, device: torch.device | str, block_size: int | None = None, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The backend called `name` for `device`.

    "auto" is flash_attn when it imports on CUDA (and `block_size` and `dtype`, the KV cache's, when given,
    meet its paged-KV constraints: fp32 and FP8 pages do not), else triton on CUDA (when installed), else torch. An
    unknown name, or a backend that cannot run on `device`, raises ValueError naming it. flash_attn
    itself falls back to triton, with a warning, for caches it cannot page.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "torch" or (name == "auto" and (device.type != "cuda" or not has_triton)):
        return TorchBackend()
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
    if not has_triton:
        raise ValueError(f"attention backend {name!r} needs triton, which is not installed")
    from kernels.triton_attention import TritonBackend

    if name == "triton":
        return TritonBackend()
    from kernels.flash_attention import PAGE_BLOCK_MULTIPLE, FlashAttnBackend, load_flash_attn, unusable_reason

    functions = load_flash_attn()
    if functions is None:
        if name == "flash_attn":
            raise ValueError("attention backend 'flash_attn' needs the flash_attn package, which does not import")
        return TritonBackend()
    # A property not given (None) is taken to suit flash-attn, as unusable_reason does.
    if name == "auto" and unusable_reason(block_size or PAGE_BLOCK_MULTIPLE, dtype) is not None:
        return TritonBackend()
    return FlashAttnBackend(*functions, fallback=TritonBackend())
