"""The batched LoRA op: one step's tokens each add their own adapter's low-rank product to a layer's output.

y[t] += (x[t] A[s]^T) B[s]^T for token t of adapter slot s (s = -1: the base model, nothing added). A layer's
adapters live stacked in slots: ``lora_a`` [slots, n * R, in] holds the down-projections of the layer's n fused
outputs (q/k/v: 3) one above the other, each zero-padded to rank R; ``lora_bs[j]`` [slots, size_j, R] is output
j's up-projection with the adapter's scaling folded in, landing at columns [offsets[j], offsets[j] + size_j) of y.
Zero padding adds exact zeros, so adapters of any rank up to R share the slots and give the unpadded result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LoraBatch:
    """Which tokens of a step use which adapter slot. ``groups`` (the torch path's view) holds (slot, token
    indices) for each slot the step uses, the indices None when every token of the step uses that one slot (no
    gather needed); ``token_slots`` (CUDA, the Triton op's view) is each token's slot. Built once per step on the
    host (``set``); every LoRA layer holds this one object and reads it during the step."""

    groups: list[tuple[int, torch.Tensor | None]]
    token_slots: torch.Tensor | None = None  # CUDA: each token's slot on the device, for the Triton op

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """The step whose token t uses slot ``token_slots[t]`` (-1: none)."""
        if device.type == "cuda":
            self.token_slots = torch.from_numpy(token_slots).to(device, non_blocking=True)
        slots = np.unique(token_slots)
        if len(slots) == 1:
            self.groups = [] if slots[0] < 0 else [(int(slots[0]), None)]
            return
        self.groups = [
            (int(slot), torch.from_numpy(np.nonzero(token_slots == slot)[0]).to(device, non_blocking=True))
            for slot in slots[slots >= 0]
        ]


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bs: list[torch.Tensor],
    offsets: list[int],
    batch: LoraBatch,
) -> None:
    """y += each token's adapter product, in place (the torch path: one shrink and n expands per slot used)."""
    rank = lora_bs[0].shape[-1]
    for slot, index in batch.groups:
        xs = x if index is None else x.index_select(0, index)
        shrunk = xs @ lora_a[slot].T
        for j, (b, offset) in enumerate(zip(lora_bs, offsets)):
            delta = shrunk[:, j * rank : (j + 1) * rank] @ b[slot].T
            out = y[:, offset : offset + b.shape[1]]
            if index is None:
                out += delta
            else:
                out.index_add_(0, index, delta)
