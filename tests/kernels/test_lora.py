"""The torch batched LoRA op (kernels/lora.py) against each token's own product, computed one token at a time."""

import numpy as np
import pytest
import torch

from kernels.lora import LoraBatch, add_lora


@pytest.mark.parametrize(
    "slots",
    [
        [1, 1, 1],
        [-1, -1, 0, 0, 1, 1, 2, 2],
        [2, -1, 0, 2, 1, -1, 1, 0],
        [-1, 2, -1],
        [-1, -1],
        [0, 0, 0, 0, 0, 0, -1, 2],
        [0, 0, 2, 2],
    ],
    ids=[
        "one adapter",
        "the base, then three adapters evenly (one batched product)",
        "three adapters and the base interleaved (a run per token)",
        "one adapter and the base",
        "base only",
        "skewed counts (a run per slot)",
        "even counts of slots not consecutive (a run per slot)",
    ],
)
def test_each_token_gets_its_own_adapters_product(slots):
    """Two fused outputs (sizes 40 and 24) of rank 8 in 3 slots; y is 8 columns wider than the outputs."""
    g = torch.Generator().manual_seed(0)
    rank, k, sizes, offsets = 8, 32, [40, 24], [0, 40]
    x = torch.randn(len(slots), k, generator=g)
    lora_a = torch.randn(3, 2 * rank, k, generator=g)
    lora_bs = [torch.randn(3, rank, size, generator=g) for size in sizes]
    y = torch.randn(len(slots), sum(sizes) + 8, generator=g)
    expected = y.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            for j, (b, offset) in enumerate(zip(lora_bs, offsets)):
                shrunk = x[t] @ lora_a[s, j * rank : (j + 1) * rank].T
                expected[t, offset : offset + b.shape[2]] += shrunk @ b[s]
    batch = LoraBatch([])
    batch.set(np.array(slots))
    add_lora(y, x, lora_a, lora_bs, offsets, batch)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_one_batch_object_reset_by_each_step():
    """Every layer holds one LoraBatch for the whole run: an even mix, then a base-only step, then one adapter,
    then an uneven mix; nothing of an earlier step's view may stay (a stale run would add adapters to base
    tokens)."""
    g = torch.Generator().manual_seed(1)
    lora_a, lora_b = torch.randn(3, 8, 16, generator=g), torch.randn(3, 8, 24, generator=g)
    batch = LoraBatch([])
    for slots in ([0, 0, 1, 1, 2, 2], [-1, -1, -1], [1, 1], [0, -1, 0, 0, 0, 0, 0, 2]):
        x, y = torch.randn(len(slots), 16, generator=g), torch.randn(len(slots), 24, generator=g)
        expected = y.clone()
        for t, s in enumerate(slots):
            if s >= 0:
                expected[t] += (x[t] @ lora_a[s].T) @ lora_b[s]
        batch.set(np.array(slots))
        add_lora(y, x, lora_a, [lora_b], [0], batch)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
