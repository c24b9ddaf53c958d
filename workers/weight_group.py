"""A collective group between a trainer and an engine's ranks, over which the trainer broadcasts new weights (RL
rollouts, issue #71): the trainer's end (`WeightSender`) and a rank's (`join`, `receive`).

torch.distributed's own process groups, not ray.util.collective: its gloo backend needs pygloo and its NCCL one
cupy, neither a dependency of raylm, while ProcessGroupGloo and ProcessGroupNCCL come with torch. Each group is built
directly on a TCPStore of its own (under PrefixStore(group_name)), not through dist.init_process_group: the
tensor-parallel ranks already hold the process's one default group (their all-reduces), and a backend built on a
store touches no global state, so a trainer's group lives beside it, and beside other trainers' groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_S = 300  # how long a rank waits for the others to join, or for a broadcast to start


@dataclass(slots=True)
class WeightGroup:
    """One member of a group: `backend` (ProcessGroupGloo or ProcessGroupNCCL) talks through `store`, kept alive
    with it. Rank 0 is the trainer, which hosts the store. Buffers are broadcast on `device` (the GPU for NCCL).
    `buffer`: a receiving rank's, grown to the largest bucket yet and received into again by every bucket, since
    fresh memory for each costs its page faults on CPU (half a gloo broadcast's time) and the allocator's churn."""

    store: dist.Store
    backend: Any
    rank: int
    world_size: int
    device: torch.device
    buffer: torch.Tensor | None = None


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = TIMEOUT_S,
) -> WeightGroup:
    """Join group `group_name` as `rank` (0 hosts its store at master_address:master_port); returns once all
    `world_size` members have joined. NCCL binds to the current CUDA device."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return WeightGroup(
            store, dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), rank, world_size, torch.device("cpu")
        )
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        return WeightGroup(store, nccl, rank, world_size, torch.device("cuda", torch.cuda.current_device()))
    raise ValueError(f"weight update group backend {backend!r} is not one of ['gloo', 'nccl']")


def leave(group: WeightGroup) -> None:
    group.backend.shutdown()


def parse_dtype(name: str) -> torch.dtype:
    """torch's dtype named `name` ("bfloat16", or "torch.bfloat16"); ValueError naming it otherwise."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight update dtype {name!r} is not a torch dtype (e.g. 'bfloat16')")
    return dtype


def receive(group: WeightGroup, dtypes: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """One bucket: the flat uint8 buffer rank 0 broadcasts, split into tensors of these dtypes and shapes (back to
    back, in order). Only what the buffer's size needs is checked first (without a size, there is nothing to
    receive into); whatever else the bucket gets wrong is for its reader to refuse, after the broadcast, so that the
    trainer never waits on a rank that gave up. The tensors are views of the group's buffer: read them before the
    next bucket comes."""
    if len(dtypes) != len(shapes):
        raise ValueError(f"weight update bucket has {len(dtypes)} dtypes and {len(shapes)} shapes")
    parsed = [parse_dtype(d) for d in dtypes]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, parsed)]
    if group.buffer is None or group.buffer.numel() < sum(sizes):
        group.buffer = None  # the old one goes before the larger one comes
        group.buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
    buffer = group.buffer[: sum(sizes)]
    group.backend.broadcast(buffer, 0).wait()
    tensors, offset = [], 0
    for chunk, dtype, shape in zip(buffer.split(sizes), parsed, shapes):
        # A view needs its offset aligned to its dtype; a tensor after an odd-sized one is copied out instead.
        aligned = chunk if offset % dtype.itemsize == 0 else chunk.clone()
        tensors.append(aligned.view(dtype).view(shape))
        offset += chunk.numel()
    return tensors


class WeightSender:
    """The trainer's end of a group: rank 0, hosting its store, so it is started with the engine's
    init_weights_update_group (each waits for the other). For each bucket the engine is asked to
    update_weights_from_distributed(*bucket_metadata(bucket), group_name) while `send(bucket)` broadcasts it; every
    rank receives every bucket (one broadcast each), and each takes its own shards."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.group = join(
            master_address, master_port, 0, world_size, group_name, backend or default_backend(device), timeout_s
        )

    @staticmethod
    def buckets(
        named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> list[list[tuple[str, torch.Tensor]]]:
        """The tensors in order, in buckets of at most `bucket_bytes` (a larger tensor alone in its own)."""
        buckets: list[list[tuple[str, torch.Tensor]]] = []
        size = 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if not buckets or size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor))
            size += nbytes
        return buckets

    @staticmethod
    def bucket_metadata(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
        """(names, dtypes as "bfloat16", shapes): what the ranks split the broadcast buffer by."""
        return (
            [name for name, _ in bucket],
            [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [list(t.shape) for _, t in bucket],
        )

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast the bucket's tensors back to back as one flat uint8 buffer."""
        device = self.group.device
        parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        self.group.backend.broadcast(buffer, 0).wait()

    def close(self) -> None:
        leave(self.group)
