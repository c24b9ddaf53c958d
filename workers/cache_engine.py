"""This rank's share of the KV cache: one preallocated tensor, viewed per layer, and its host tier."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch


def host_memory_available() -> int:
    """Bytes of host memory this process could still take (MemAvailable; free pages where /proc is absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pinned_bytes(nbytes: int) -> int:
    """What pinning `nbytes` of host memory through torch takes: its caching host allocator (behind
    `pin_memory=True`) rounds every allocation up to a power of two, so a 40 GiB host tier pins 64 GiB."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def check_swap_space(
    swap_space_bytes: int,
    where: str = "this host",
    pinned: bool = False,
    ranks_on_host: int = 1,
    available: int | None = None,
) -> None:
    """Refuse a host tier larger than the host's available memory, before anything big is loaded. A pinned
    tier counts as `pinned_bytes` of it, and every one of the `ranks_on_host` ranks sharing the host pins its
    own; `available` defaults to host_memory_available()."""
    if swap_space_bytes <= 0:
        return
    available = host_memory_available() if available is None else available
    each = pinned_bytes(swap_space_bytes) if pinned else swap_space_bytes
    if each * ranks_on_host > available:
        takes = (
            f"pins {each} bytes (rounded up to a power of two by torch's pinned-memory allocator)"
            if pinned
            else f"takes {each} bytes"
        )
        ranks = f" on each of {ranks_on_host} ranks" if ranks_on_host > 1 else ""
        raise ValueError(
            f"swap_space_bytes={swap_space_bytes} {takes}{ranks}: more than {where} can give, "
            f"{available} bytes of memory are available"
        )


class CacheEngine:
    """Holds ``[2, num_layers, num_blocks, block_size, kv_heads_per_rank, head_dim]``, and the same shape with
    ``num_host_blocks`` blocks in host memory (pinned on CUDA) when the host tier is on.

    One tensor rather than one per layer so that the memory is claimed once
    (and counted once when sizing the cache); each attention layer gets the
    view ``kv_cache[:, layer]``. Block 0 is the scheduler's null block: it is
    allocated here but never written through a real slot. ``swap`` moves whole
    blocks across all layers in one gather and one scatter per direction.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.host_cache = None
        if num_host_blocks:
            self.host_cache = torch.zeros(
                2,
                num_layers,
                num_host_blocks,
                block_size,
                num_kv_heads,
                head_dim,
                dtype=dtype,
                pin_memory=device.type == "cuda",
            )

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def bind(self, attention_layers: list) -> None:
        if len(attention_layers) != self.kv_cache.shape[1]:
            raise ValueError(f"model has {len(attention_layers)} attention layers, cache has {self.kv_cache.shape[1]}")
        for i, layer in enumerate(attention_layers):
            layer.kv_cache = self.kv_cache[:, i]

    @staticmethod
    def unbind(attention_layers: list) -> None:
        """The layers hold no cache: their views would keep a throwaway one (the memory profile's) alive next to
        the real one."""
        for layer in attention_layers:
            layer.kv_cache = torch.empty(0)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy (device, host) pairs out, then (host, device) pairs in, before the step's forward.

        The order is the step's contract (SchedulerOutput): a swap-out reads a
        device block that a swap-in or the forward of the same step may then
        write. On CUDA the gather runs on the compute stream, so it reads the
        blocks before any later kernel writes them.
        """
        # Bytes are copied: index_copy_ has no float8 kernel on CPU (an FP8 cache, --kv-cache-dtype fp8). Host-side
        # copies go block run by block run (copy_blocks); the device's gather and scatter stay one kernel each.
        device_cache, host_cache = self.kv_cache.view(torch.uint8), self.host_cache.view(torch.uint8)
        dev = device_cache.device
        if swap_out:
            src, dst = zip(*swap_out)
            if dev.type == "cuda":  # gathered on the device first: one copy to the host, not one per run
                copy_blocks(host_cache, dst, gather_blocks(device_cache, src).cpu(), range(len(dst)))
            else:
                copy_blocks(host_cache, dst, device_cache, src)
        if swap_in:
            src, dst = zip(*swap_in)
            if dev.type == "cuda":
                blocks = gather_blocks(host_cache, src).pin_memory().to(dev, non_blocking=True)
                device_cache.index_copy_(2, torch.tensor(dst, device=dev), blocks)
            else:
                copy_blocks(device_cache, dst, host_cache, src)

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """These blocks of every layer, keys and values, as one host array of the cache's raw bytes
        (``[2, num_layers, len(block_ids), block_size, kv_heads, head_dim * itemsize]`` uint8): what a KV transfer
        sends. Raw bytes so that any KV dtype (FP8 included) crosses processes as it is stored."""
        return gather_blocks(self.kv_cache.view(torch.uint8), block_ids).cpu().numpy()

    def write_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        """Write ``blocks`` (read_blocks' layout, this rank's heads) into these blocks; a ValueError naming both
        shapes when they do not fit (engines that differ in model, block size or KV dtype)."""
        cache = self.kv_cache.view(torch.uint8)
        two, layers, _, block_size, heads, width = cache.shape
        if blocks.shape != (two, layers, len(block_ids), block_size, heads, width):
            raise ValueError(
                f"KV blocks of shape {tuple(blocks.shape)} (bytes) do not fit {len(block_ids)} blocks of this cache, "
                f"{(two, layers, len(block_ids), block_size, heads, width)}: the engines differ in model, block size "
                f"or KV dtype"
            )
        with warnings.catch_warnings():  # a read-only view of the object store's buffer: index_copy_ only reads it
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(np.ascontiguousarray(blocks))
        if cache.device.type == "cuda":  # one scatter kernel
            cache.index_copy_(2, torch.tensor(block_ids, device=cache.device), src.pin_memory().to(cache.device))
        else:
            copy_blocks(cache, block_ids, src, range(len(block_ids)))


def block_runs(dst_ids: Sequence[int], src_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Block pairs (dst_ids[i], src_ids[i]) as runs where both ids go up by one: (first dst, first src, length).
    Copies go run by run as strided slices: on CPU, uint8 index_copy_ measured 10x slower than slice copies (418 vs
    5,671 MiB/s for 128 consecutive blocks of SmolLM2's shape; 236 vs 25 ms for 128 scattered ones)."""
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst_ids, src_ids):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((d, s, 1))
    return runs


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
    """``dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]]`` for every i (block tensors: axis 2 is the block)."""
    for d, s, n in block_runs(dst_ids, src_ids):
        dst[:, :, d : d + n].copy_(src[:, :, s : s + n])


def gather_blocks(cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """These blocks of ``cache`` as a new tensor on its device, in order (one gather kernel on a GPU)."""
    if cache.device.type == "cuda":
        return cache.index_select(2, torch.tensor(block_ids, device=cache.device))
    out = cache.new_empty(cache.shape[:2] + (len(block_ids),) + cache.shape[3:])
    copy_blocks(out, range(len(block_ids)), cache, block_ids)
    return out
