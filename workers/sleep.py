"""A rank's memory given back while it sleeps (RL rollouts, issue #71: the trainer takes the device between rollouts)
and taken again on waking: the KV cache, and the weights (moved to the host, or freed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

TAGS = ("weights", "kv_cache")


@dataclass(slots=True)
class SleepState:
    """What a rank gave back, so that wake_up brings exactly that back.

    Invariants: `asleep` holds the TAGS now asleep. With "kv_cache" asleep no attention layer holds a cache, and
    `kv_blocks` is the (device, host) block count to allocate again (the scheduler's block ids keep their meaning).
    With "weights" asleep every parameter of the rank's models holds an empty tensor, its values either in
    `offloaded` (level 1 on CUDA: a pinned host copy each) or gone (`freed`: the shape each takes again). `reload`:
    the start-up checkpoint's tensors to read back once weights and KV cache are both awake (after level 2), less
    those an update wrote meanwhile; None when nothing is to be read."""

    asleep: set[str] = field(default_factory=set)
    kv_blocks: tuple[int, int] = (0, 0)
    offloaded: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    freed: list[tuple[nn.Parameter, torch.Size]] = field(default_factory=list)
    reload: set[str] | None = None


def check_tags(tags: list[str] | None) -> list[str]:
    """`tags`, None meaning all; ValueError naming one that is not a TAG."""
    if tags is None:
        return list(TAGS)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"unknown wake_up tag {unknown[0]!r}; tags are {list(TAGS)}")
    return list(tags)


def _empty(param: nn.Parameter) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


def offload(params: list[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Each parameter's values copied into pinned host memory (one allocation each: torch's pinned allocator rounds
    each up to a power of two), its device storage let go. The Parameter objects stay (their loaders with them)."""
    moved = []
    for p in params:
        moved.append((p, torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.detach())))
        p.data = _empty(p)
    return moved


def restore(offloaded: list[tuple[nn.Parameter, torch.Tensor]], device: torch.device) -> None:
    for p, host in offloaded:
        p.data = host.to(device)


def free(params: list[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Size]]:
    """Each parameter's storage let go; its shape kept for `allocate`."""
    shapes = [(p, p.shape) for p in params]
    for p in params:
        p.data = _empty(p)
    return shapes


def allocate(freed: list[tuple[nn.Parameter, torch.Size]]) -> None:
    """Zeros (not garbage: an FP8 layer requantized before every row is read back must find finite values)."""
    for p, shape in freed:
        p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)


def drop_packed(model: nn.Module) -> None:
    """Let the CPU-packed copies (workers.layers.pack_for_cpu) go with the weights they were made from."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.packed = None
        elif isinstance(module, VocabParallelEmbedding):
            module.packed_head = None
