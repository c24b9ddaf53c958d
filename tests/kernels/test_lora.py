"""The torch batched LoRA op (kernels/lora.py) against each token's own product, computed one token at a time."""

import numpy as np
import pytest
import torch

from kernels.lora import LoraBatch, add_lora


@pytest.mark.parametrize(
    "slots",
    [[1, 1, 1], [2, -1, 0, 2, 1, -1, 1, 0], [2, 0, 2, 0, -1], [-1, 2, -1], [-1, -1], [0, 0, 0, 0, 0, 0, -1, 2]],
    ids=[
        "one adapter",
        "three adapters and the base interleaved (padded to a batch)",
        "two adapters and the base (padded, slot 1 all padding)",
        "one adapter and the base (per-slot slices)",
        "base only",
        "skewed counts (per-slot slices)",
    ],
)
def test_each_token_gets_its_own_adapters_product(slots):
    """Two fused outputs (sizes 40 and 24) of rank 8 in 3 slots; y is 8 columns wider than the outputs."""
    g = torch.Generator().manual_seed(0)
    rank, k, sizes, offsets = 8, 32, [40, 24], [0, 40]
    x = torch.randn(len(slots), k, generator=g)
    lora_a = torch.randn(3, 2 * rank, k, generator=g)
    lora_b = torch.zeros(3, 2 * rank, sum(sizes))
    for j, (size, offset) in enumerate(zip(sizes, offsets)):
        lora_b[:, j * rank : (j + 1) * rank, offset : offset + size] = torch.randn(3, rank, size, generator=g)
    y = torch.randn(len(slots), sum(sizes) + 8, generator=g)
    expected = y.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expected[t, : sum(sizes)] += (x[t] @ lora_a[s].T) @ lora_b[s]
    batch = LoraBatch([])
    batch.set(np.array(slots), torch.device("cpu"))
    add_lora(y, x, lora_a, lora_b, batch)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_one_batch_object_reset_by_each_step():
    """Every layer holds one LoraBatch for the whole run: a mixed step, then a base-only step, then one adapter;
    nothing of an earlier step's view may stay (a stale gather index would add adapters to base tokens)."""
    g = torch.Generator().manual_seed(1)
    lora_a, lora_b = torch.randn(3, 8, 16, generator=g), torch.randn(3, 8, 24, generator=g)
    batch = LoraBatch([])
    for slots in ([2, 0, 2, 0, 1, 1], [-1, -1, -1], [1, 1], [0, -1, 0, 0, 0, 0, 0, 2]):
        x, y = torch.randn(len(slots), 16, generator=g), torch.randn(len(slots), 24, generator=g)
        expected = y.clone()
        for t, s in enumerate(slots):
            if s >= 0:
                expected[t] += (x[t] @ lora_a[s].T) @ lora_b[s]
        batch.set(np.array(slots), torch.device("cpu"))
        add_lora(y, x, lora_a, lora_b, batch)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
