"""Which part of the model a rank holds and whom it talks to: its pipeline stage (a contiguous run of layers)
and its tensor-parallel group. One rank per process, so this is set once per process (``set_parallel``) by
the worker as it joins the process group, before the model is built; the model classes and parallel layers
read it, so every family splits into stages the same way without a constructor argument of its own."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(slots=True, frozen=True)
class PipelineStage:
    """Stage ``index`` of ``count`` holds decoder layers [start, end).

    Invariants: the stages' ranges are contiguous and cover every layer once;
    the first stage embeds the tokens, the last applies the final norm and the
    LM head and samples; ``end`` is None only for the whole model (one stage).
    """

    index: int = 0
    count: int = 1
    start: int = 0
    end: int | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def owns(self, layer: int) -> bool:
        return self.start <= layer and (self.end is None or layer < self.end)

    def num_layers(self, total: int) -> int:
        return (total if self.end is None else self.end) - self.start


def partition_layers(num_layers: int, pp_size: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's [start, end) of layers: ``partition`` (layers per stage), else as even as counts allow, the
    earlier stages taking the extra layer (the last also runs the LM head and sampler). ValueError naming the
    setting and the numbers when the split is impossible."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} is more than the model's {num_layers} layers: every stage needs one"
        )
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = [base + (s < extra) for s in range(pp_size)]
    elif len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"pp_layer_partition={','.join(map(str, partition))} must give each of pipeline_parallel_size="
            f"{pp_size} stages at least one layer and sum to the model's {num_layers} layers "
            f"(it has {len(partition)} entries summing to {sum(partition)})"
        )
    bounds, start = [], 0
    for n in partition:
        bounds.append((start, start + n))
        start += n
    return bounds


class MissingLayer(nn.Module):
    """Where another stage's module would be: no parameters (so the loader reads none of its weights) and
    never called. It keeps the layers' indices, and so their checkpoint names, the same on every stage."""


@dataclass(slots=True)
class _Parallel:
    stage: PipelineStage
    tp_group: dist.ProcessGroup | None  # None: the default group (the whole world is one stage)


_state = _Parallel(PipelineStage(), None)


def set_parallel(stage: PipelineStage, tp_group: dist.ProcessGroup | None) -> None:
    _state.stage, _state.tp_group = stage, tp_group


def pipeline_stage() -> PipelineStage:
    return _state.stage


def tp_group() -> dist.ProcessGroup | None:
    """The group a tensor-parallel collective runs over: this stage's ranks."""
    return _state.tp_group


def stage_modules(num_layers: int, build) -> nn.ModuleList:
    """The decoder layers as a list indexed like the checkpoint: ``build(i)`` for this stage's layers, a
    MissingLayer for the others'."""
    stage = _state.stage
    return nn.ModuleList(build(i) if stage.owns(i) else MissingLayer() for i in range(num_layers))


class StageLink:
    """Hands a step's (hidden, residual) from this stage to the next: the same tensor-parallel rank of the
    neighbouring stages, point to point over the world group (gloo on CPU, NCCL on GPU).

    Invariants: every rank runs the steps in the order the scheduler sent them, so the n-th tensor a stage
    receives is the n-th its previous stage sent, and both sides know its shape from the step itself (its
    token count): nothing but the activations travels. A send is asynchronous, so a stage goes on to its next
    step while the next stage receives; its buffer is kept until the send completed, and at most one send is
    outstanding (the next send waits for the previous one: backpressure when the next stage is slower).
    """

    def __init__(
        self, prev_rank: int | None, next_rank: int | None, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.pending: list = []  # (work, buffer) of the send in progress
        self.bytes_sent = 0
        self.wait_s = 0.0  # blocked in recv (waiting for the previous stage, and the transfer) or on a send

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        dist.recv(buf, src=self.prev_rank)
        self.wait_s += time.perf_counter() - start
        return buf[0], buf[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        buf = torch.stack((hidden, residual))
        start = time.perf_counter()
        for work, _ in self.pending:
            work.wait()
        self.pending = [(dist.isend(buf, dst=self.next_rank), buf)]
        self.wait_s += time.perf_counter() - start
        self.bytes_sent += buf.numel() * buf.element_size()
