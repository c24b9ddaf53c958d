"""The batched LoRA op: one step's tokens each add their own adapter's low-rank product to a layer's output.

y[t] += (x[t] A[s]^T) B[s] for token t of adapter slot s (s = -1: the base model, nothing added). A layer's
adapters live stacked in slots: ``lora_a`` [slots, n * R, in] holds the down-projections of the layer's n fused
outputs (q/k/v: 3) one above the other, each zero-padded to rank R; ``lora_b`` [slots, n * R, out] their
up-projections block-diagonally, the adapter's scaling folded in: rows [j * R, (j + 1) * R) of output j land at
its columns of y. Zero padding adds exact zeros, so adapters of any rank up to R share the slots and give the
unpadded result, and a layer's n outputs take one matmul per slot instead of n.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LoraBatch:
    """Which tokens of a step use which adapter slot, built once per step on the host (``set``); every LoRA layer
    holds this one object and reads it during the step. The torch path's views:
    - ``single``: the one slot every token of the step uses (no gather), or None;
    - ``spans``: each used slot's rows [start, end) among the adapted tokens sorted by slot (``order``);
    - ``padded``: a step whose slots' token counts are even enough pads each slot in [0, num_slots) to the largest
      count and runs all of them in one batched matmul (``order`` then lists each padded row's token, 0 on a
      padding row, which ``padding`` zeroes). Skewed counts would pad into wasted rows: they take ``spans``.
    ``token_slots`` (CUDA, the Triton op's view) is each token's slot."""

    spans: list[tuple[int, int, int]]
    single: int | None = None
    order: torch.Tensor | None = None
    padding: torch.Tensor | None = None  # [num_slots * G, 1] bool: True on a padded step's padding rows
    num_slots: int = 0
    token_slots: torch.Tensor | None = None  # CUDA: each token's slot on the device, for the Triton op

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """The step whose token t uses slot ``token_slots[t]`` (-1: none)."""
        self.single, self.order, self.padding = None, None, None  # nothing of the last step's view stays
        self.spans = []
        if token_slots.max(initial=-1) < 0:  # the base model alone: nothing to sort or upload
            return
        if device.type == "cuda":
            self.token_slots = torch.from_numpy(token_slots).to(device, non_blocking=True)
        slots, counts = np.unique(token_slots, return_counts=True)
        adapted = slots >= 0
        if len(slots) == 1:
            self.single = int(slots[0])
            return
        slots, counts = slots[adapted], counts[adapted]
        first = len(token_slots) - int(counts.sum())  # the base model's tokens sort first: left out
        order = np.argsort(token_slots, kind="stable")[first:]
        self.num_slots, group = int(slots[-1]) + 1, int(counts.max())
        if self.num_slots * group <= 2 * len(order):
            rank = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
            index = np.zeros((self.num_slots, group), dtype=np.int64)
            index[token_slots[order], rank] = order
            padding = np.ones((self.num_slots, group, 1), dtype=bool)
            padding[token_slots[order], rank] = False
            self.padding = torch.from_numpy(padding.reshape(-1, 1)).to(device, non_blocking=True)
            order = index.reshape(-1)
        else:
            ends = np.cumsum(counts)
            self.spans = [(int(s), int(e - c), int(e)) for s, c, e in zip(slots, counts, ends)]
        self.order = torch.from_numpy(order).to(device, non_blocking=True)

    @property
    def active(self) -> bool:
        return self.single is not None or self.order is not None


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch: LoraBatch) -> None:
    """y += each token's adapter product, in place (the torch path): a constant number of ops per layer, not a
    few per adapter, where the step's slots are evenly used (the per-op cost is what a CPU step pays here).
    One slot: two matmuls. Several: the adapted tokens gathered, a shrink and an expand (batched over the padded
    slots, or per slot on contiguous slices), and one scatter-add back."""
    out = y[:, : lora_b.shape[2]]  # the layer's outputs (the whole of y, but where a caller's y is wider)
    if batch.single is not None:
        out.addmm_(x @ lora_a[batch.single].T, lora_b[batch.single])
        return
    if batch.order is None:
        return
    xs = x.index_select(0, batch.order)
    if batch.padding is not None:
        n = batch.num_slots
        xs.masked_fill_(batch.padding, 0)
        shrunk = torch.bmm(xs.view(n, -1, xs.shape[1]), lora_a[:n].transpose(1, 2))
        delta = torch.bmm(shrunk, lora_b[:n]).view(xs.shape[0], -1)
    else:
        shrunk = xs.new_empty(xs.shape[0], lora_a.shape[1])
        delta = xs.new_empty(xs.shape[0], lora_b.shape[2])
        for slot, start, end in batch.spans:
            torch.mm(xs[start:end], lora_a[slot].T, out=shrunk[start:end])
            torch.mm(shrunk[start:end], lora_b[slot], out=delta[start:end])
    out.index_add_(0, batch.order, delta)
