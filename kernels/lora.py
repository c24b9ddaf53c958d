"""The batched LoRA op: one step's tokens each add their own adapter's low-rank product to a layer's output.

y[t] += (x[t] A[s]^T) B[s] for token t of adapter slot s (s = -1: the base model, nothing added). A layer's
adapters live stacked in slots: ``lora_a`` [slots, n * R, in] holds the down-projections of the layer's n fused
outputs (q/k/v: 3) one above the other, each zero-padded to rank R; ``lora_bs[j]`` [slots, R, size_j] output j's
up-projection, the adapter's scaling folded in, landing at columns [offsets[j], offsets[j] + size_j) of y. Zero
padding adds exact zeros, so adapters of any rank up to R share the slots and give the unpadded result.

Each output expands on its own (a block-diagonal B would multiply by its zero blocks: twice the expand's work
for gate/up, three times for q/k/v, and as many times the B bytes a decode step reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LoraBatch:
    """Which tokens of a step use which adapter slot; every LoRA layer holds this one object and reads it during the
    step. On CUDA, ``token_slots`` is each token's slot (-1: the base model) in a device buffer that keeps its
    address for the runner's life (the runner writes it with the step's other inputs), read by the Triton op at
    the step's token count: a captured decode graph replays it for any mix of adapters. Elsewhere, the torch path's
    views, built on the host each step (``set``), both of contiguous rows: a step's requests come grouped by slot
    (the model runner orders them so), so no token is gathered or scattered:
    - ``runs``: each run of consecutive tokens of one slot, (slot, start, end); the base model's tokens left out;
    - ``uniform``: (first slot, first row, runs, rows each) where the runs are adjacent, equally long and of
      consecutive slots (a step of evenly mixed adapters): all of them in one batched product per output."""

    runs: list[tuple[int, int, int]]
    uniform: tuple[int, int, int, int] | None = None
    token_slots: torch.Tensor | None = None

    def set(self, token_slots: np.ndarray) -> None:
        """The step whose token t uses slot ``token_slots[t]`` (-1: none), for the torch path."""
        self.runs, self.uniform = [], None  # nothing of the last step's view stays
        starts = np.flatnonzero(np.diff(token_slots, prepend=-2))
        ends = np.append(starts[1:], len(token_slots))
        slots = token_slots[starts]
        keep = slots >= 0
        starts, ends, slots = starts[keep], ends[keep], slots[keep]
        self.runs = [(int(s), int(b), int(e)) for s, b, e in zip(slots, starts, ends)]
        lengths = ends - starts
        if (
            len(slots) > 1
            and (lengths == lengths[0]).all()
            and (starts[1:] == ends[:-1]).all()
            and (np.diff(slots) == 1).all()
        ):
            self.uniform = (int(slots[0]), int(starts[0]), len(slots), int(lengths[0]))


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bs: list[torch.Tensor],
    offsets: list[int],
    batch: LoraBatch,
) -> None:
    """y += each token's adapter product, in place (the torch path), straight into y's rows: a shrink and one
    expand per output for the step's evenly mixed adapters together, else the same for each run of one slot."""
    rank = lora_bs[0].shape[1]
    if batch.uniform is not None:
        slot, start, n, rows = batch.uniform
        end = start + n * rows
        shrunk = torch.bmm(x[start:end].reshape(n, rows, -1), lora_a[slot : slot + n].transpose(1, 2))
        out = y[start:end].view(n, rows, -1)
        for j, (b, offset) in enumerate(zip(lora_bs, offsets)):
            out[:, :, offset : offset + b.shape[2]].baddbmm_(
                shrunk[:, :, j * rank : (j + 1) * rank], b[slot : slot + n]
            )
        return
    for slot, start, end in batch.runs:
        shrunk = x[start:end] @ lora_a[slot].T
        for j, (b, offset) in enumerate(zip(lora_bs, offsets)):
            y[start:end, offset : offset + b.shape[2]].addmm_(shrunk[:, j * rank : (j + 1) * rank], b[slot])
