"""The router's top-k on CUDA (kernels/triton_route.py, one Triton kernel) against kernels.moe's torch path (run on
CPU tensors), under the Triton interpreter on CPU: the same experts in the same order, the same weights."""

import os
import sys
from unittest import mock

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # As in test_triton_attention.py: @triton.jit reads this when it decorates, so before triton's first import.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
    )
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import moe, triton_route  # noqa: E402


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Each row `experts` distinct values of `dtype` drawn from 3 * randn: no ties, whose order torch.topk leaves
    unspecified (test_ties_go_to_the_lowest_expert holds the kernel to its own)."""
    g = torch.Generator().manual_seed(experts * 100 + tokens)
    pool = (3 * torch.randn(4096, generator=g)).to(dtype).unique()
    return torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:experts]] for _ in range(tokens)])


def assert_matches_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    expected_weights, expected_ids = moe.route(logits, top_k, renormalize)  # CPU tensors: the torch path
    weights, ids = triton_route.route(logits.to(DEVICE), top_k, renormalize)
    assert (weights.dtype, ids.dtype) == (torch.float32, torch.int64)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=0, atol=1e-6)


# On CUDA each combination is a compile (seconds each in the GPU check's few minutes): the model's dtype there, every
# dtype under the interpreter, and tests/kernels/gpu_compile.py compiles fp32 for the GPUs.
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["softmax", "renormalized"])
@pytest.mark.parametrize(("experts", "top_k"), [(e, k) for e in (8, 60, 128) for k in (1, 2, 8) if k <= e], ids=str)
def test_matches_torch_softmax_topk(experts, top_k, renormalize, dtype):
    assert_matches_torch(distinct_logits(5, experts, dtype), top_k, renormalize)


# Token counts apart from the product above: under the interpreter each token is a program of some 10 ms.
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_every_token_gets_its_own_row(tokens):
    assert_matches_torch(distinct_logits(tokens, 60, torch.bfloat16), 2, renormalize=True)


def test_ties_go_to_the_lowest_expert():
    # 60 experts pad to 64 lanes, whose probability is 0: equal logits, or probabilities that underflow to 0, must
    # choose experts in index order and never a padding lane. Row 1's exp would overflow without the max taken off.
    logits = torch.zeros(3, 60)
    logits[1] = 100.0
    logits[1, [7, 30, 59]] = 101.0
    logits[2] = -200.0
    logits[2, 42] = 0.0
    weights, ids = triton_route.route(logits.to(DEVICE), 4, renormalize=False)
    assert ids.tolist() == [[0, 1, 2, 3], [7, 30, 59, 0], [42, 0, 1, 2]]
    high, low = 1 / (3 + 57 * torch.e**-1), torch.e**-1 / (3 + 57 * torch.e**-1)
    expected = torch.tensor([[1 / 60] * 4, [high, high, high, low], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(weights.cpu(), expected, rtol=1e-6, atol=0)


def test_no_tokens_returns_empty_without_a_launch():
    with mock.patch.object(triton_route, "_route_kernel", None):  # a launch would raise TypeError
        weights, ids = triton_route.route(torch.zeros(0, 60, device=DEVICE), 8, renormalize=True)
    assert weights.shape == ids.shape == (0, 8)
    assert (weights.dtype, ids.dtype) == (torch.float32, torch.int64)


def test_top_k_above_the_expert_count_is_a_value_error():
    with pytest.raises(ValueError, match=r"top_k 9 with 8 experts"):
        triton_route.route(torch.zeros(3, 8, device=DEVICE), 9, renormalize=False)
