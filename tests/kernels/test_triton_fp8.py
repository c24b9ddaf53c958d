"""FP8 products: the per-token quantization kernel against the torch path (bit for bit), and `fp8_linear` against
float64 products of the values it stands for and of the unquantized operands. Compiled on CUDA when there is a
GPU (of compute capability 8.9 or above), else on CPU tensors under the Triton interpreter; `fp8_linear`'s
`torch._scaled_mm` is torch's own CPU op there."""

import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # As in test_triton_attention.py: @triton.jit reads this when it decorates.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
    )
    os.environ["TRITON_INTERPRET"] = "1"
elif torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 products need compute capability 8.9 or above", allow_module_level=True)

from kernels import fp8  # noqa: E402
from kernels.triton_fp8 import quantize_per_token  # noqa: E402

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def torch_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of kernels/fp8.py, whatever the device (a CPU copy of x takes it)."""
    x_fp8, scale = fp8.quantize_per_token(x.cpu())
    return x_fp8.to(x.device), scale.to(x.device)


def activations(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (a row's scale is its own), in a view whose row stride is wider than its
    columns; one row all zeros (the smallest scale), one with values that round up across a power of two."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols + 8, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    x[1] = 0.0
    x[2, 0], x[2, 1] = 448.0, 124.6  # 124.6 on FP8's grid is 128
    return x.to(dtype)[:, 5 : 5 + cols].to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [64, 200])  # 200: a row of a partial block
def test_the_kernel_quantizes_as_the_torch_path_does(dtype, cols):
    x = activations(7, cols, dtype, cols)
    got, got_scale = quantize_per_token(x)
    want, want_scale = torch_quantize(x)
    assert got.dtype == torch.float8_e4m3fn and got_scale.shape == (7, 1) and got_scale.dtype == torch.float32
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got.float(), want.float())  # as floats: a tiny negative value may give -0 or +0
    amax = got.float().abs().amax(dim=1)
    assert bool((amax[torch.arange(7) != 1] == FP8_MAX).all())  # each row's largest magnitude is 448
    assert float(got_scale[1]) == float(torch.tensor(fp8.MIN_SCALE))  # in fp32


def operands(dtype: torch.dtype, seed: int = 0):
    """x [5, 96] with rows of different magnitudes, a weight [48, 96] quantized per row, a bias."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 96, generator=gen) * torch.tensor([[0.01], [1.0], [3.0], [50.0], [0.5]])).to(dtype)
    w = torch.randn(48, 96, generator=gen) * torch.rand(48, 1, generator=gen)
    w_fp8, w_scale = fp8.quantize_per_token(w)
    bias = torch.randn(48, generator=gen).to(dtype)
    return x.to(DEVICE), w, w_fp8.to(DEVICE), w_scale.view(-1).to(DEVICE), bias.to(DEVICE)


def skip_unsupported(dtype: torch.dtype) -> None:
    """Skip where this torch build's CUDA `_scaled_mm` takes no row-wise product with a `dtype` output."""
    why = fp8.unsupported(torch.device(DEVICE), dtype) if DEVICE == "cuda" else None
    if why is not None:
        pytest.skip(why)


OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_fp8_linear_is_the_product_of_the_values_its_operands_stand_for(dtype):
    skip_unsupported(dtype)
    x, _, w_fp8, w_scale, bias = operands(dtype)
    got = fp8.fp8_linear(x, w_fp8, w_scale, bias)
    assert got.dtype == dtype and got.shape == (5, 48)
    x_fp8, x_scale = torch_quantize(x)
    xd, wd = x_fp8.double() * x_scale.double(), w_fp8.double() * w_scale.double()[:, None]
    product = xd @ wd.T
    # FP8 products are exact in fp32; each of the K = 96 fp32 additions rounds by 2^-24 of the sum so far, and the
    # output by one unit in its last place, for the product and for the bias added to it.
    accumulation = 96 * 2**-24 * (xd.abs() @ wd.abs().T)
    bound = torch.finfo(dtype).eps * (product.abs() + bias.double().abs()) + accumulation
    assert bool(((got.double() - (product + bias.double())).abs() <= bound).all())


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_fp8_linear_is_close_to_the_unquantized_product(dtype):
    skip_unsupported(dtype)
    x, w, w_fp8, w_scale, _ = operands(dtype, seed=1)
    got = fp8.fp8_linear(x, w_fp8, w_scale).double().cpu()
    xd, wd = x.double().cpu(), w.double()
    exact = xd @ wd.T
    # Each operand's element is within 2^-4 of itself (3 mantissa bits, rounded to nearest): a product's terms
    # within 2^-3 + 2^-8 of theirs, whatever their signs; the output's rounding on top.
    bound = (2**-3 + 2**-8) * (xd.abs() @ wd.abs().T) + torch.finfo(dtype).eps * exact.abs()
    assert bool(((got - exact).abs() <= bound).all())
    # Rounding errors of random signs mostly cancel: typically a few percent of the product, per row.
    relative = (got - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(relative.max()) < 0.05, relative
