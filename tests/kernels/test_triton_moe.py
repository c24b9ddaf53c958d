"""The Triton grouped matmul against torch's (the CPU path), under the Triton interpreter on CPU."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # As in test_triton_attention.py: @triton.jit reads this when it decorates, so before triton's first import.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
    )
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.triton_moe import grouped_mm  # noqa: E402


@pytest.mark.parametrize(
    "counts",
    [[1, 0, 0, 0], [0, 70, 0, 3], [5, 33, 0, 40], [0, 0, 0, 0]],
    ids=["one token", "one expert takes most, two none", "uneven, tiles past a group's end", "no tokens"],
)
def test_grouped_mm_matches_torch(counts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 48, generator=g)
    w = torch.randn(len(counts), 80, 48, generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    expected = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    out = grouped_mm(x.to(DEVICE), w.to(DEVICE), offs.to(DEVICE)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
