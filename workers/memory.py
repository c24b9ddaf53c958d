"""A rank's memory: glibc's reuse of freed activation buffers (CPU), and the KV cache's budget on a GPU after a
peak-memory profile."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

# glibc's mallopt parameters. A step's activations (megabytes each) are above glibc's default mmap
# threshold, so every one came from fresh pages and its page faults cost as much as the elementwise
# op that filled it (16% of a 2048-token prefill step). Raising the threshold to its 32 MiB maximum
# and keeping freed memory keeps those buffers in the heap, reused step after step.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> None:
    """Make glibc reuse freed activation buffers instead of returning them to the OS (no-op off glibc)."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def return_freed_memory(device: torch.device) -> None:
    """Hand what this process freed back to the system: torch's cached blocks on CUDA (and its pinned host blocks),
    glibc's free heap pages on CPU, where keep_freed_memory told glibc to keep them (a sleeping rank's RSS would not
    fall otherwise)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        return
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@dataclass(slots=True)
class MemorySnapshot:
    """Device memory at one moment: `used` by anyone (total - free, what the driver reports) and
    `torch_reserved` by this process's caching allocator; the difference is memory outside torch
    (CUDA context, NCCL buffers, other processes)."""

    used: int
    torch_reserved: int

    @classmethod
    def take(cls) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info()
        return cls(total - free, torch.cuda.memory_reserved())


@dataclass(slots=True)
class MemoryProfile:
    """What a GPU rank's peak-memory profile measured (Worker._profile_memory): the device's `total`, the memory in
    use `before` the profile and `after` its throwaway caches went back to the driver, its `peak` (profile_peak's,
    the target's step or the draft's forward, whichever is larger), and the forwards' own peaks over the profile's
    tokens, from which the graph pools are estimated: the target's, and the draft's (0 without one)."""

    total: int
    before: MemorySnapshot
    after: MemorySnapshot
    peak: int
    forward_peak: int
    draft_forward_peak: int


def kv_cache_budget(
    total: int,
    utilization: float,
    before: MemorySnapshot,
    after: MemorySnapshot,
    profile_peak: int,
    graph_pool: int = 0,
) -> int:
    """Bytes left for the KV cache: the share of the device we may use, less what was in use before
    the profile (weights, context, others), the profile's peak (activations, logits and sampler at
    full width), memory outside torch that appeared during the profile (NCCL allocates its buffers at
    the first collective, which the profile makes, and torch's allocator never sees them), and the
    CUDA graphs' private pool, captured only after the cache exists (`graph_pool`, an estimate).
    `after` is taken once the profile's blocks went back to the driver (empty_cache)."""
    non_torch_growth = max((after.used - after.torch_reserved) - (before.used - before.torch_reserved), 0)
    return int(total * utilization) - before.used - profile_peak - non_torch_growth - graph_pool


def profile_peak(allocated_start: int, allocated_peak: int, reserved_start: int, reserved_peak: int) -> int:
    """The profile's peak as the device sees it: what torch's caching allocator reserved for it, which is
    the tensors' peak plus the fragmentation between them (never less than the tensors' peak)."""
    return max(allocated_peak - allocated_start, reserved_peak - reserved_start)


def graph_pool_bytes(forward_peak: int, forward_tokens: int, max_graph_tokens: int) -> int:
    """An estimate of the CUDA graphs' private pool: the activations of the captured graph of the most tokens (a
    decode's one a request, or a verification's 1 + k), scaled from the profile forward's peak over
    `forward_tokens` tokens (activations grow with tokens; the smaller graphs share the largest one's pool). 0
    without graphs."""
    if not max_graph_tokens or forward_tokens <= 0:
        return 0
    return forward_peak * min(max_graph_tokens, forward_tokens) // forward_tokens
