"""FP8 products: the per-token (and per token group) quantization kernel against the torch path (bit for bit), and
`fp8_linear` (row-wise scales) and the block kernel (tile scales) against float64 products of the values they
stand for and of the unquantized operands. Compiled on CUDA when there is a GPU (of compute capability 8.9 or
above), else on CPU tensors under the Triton interpreter; `fp8_linear`'s `torch._scaled_mm` is torch's own CPU op
there, and the block kernel is called directly (on CPU `fp8_linear` takes the torch path, checked beside it)."""

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
from kernels.formats import FP8_MAX, MIN_SCALE  # noqa: E402
from kernels.fp8 import quantize_tiles  # noqa: E402
from kernels.triton_fp8 import block_scaled_mm, quantize_per_token  # noqa: E402


def torch_quantize(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of kernels/fp8.py, whatever the device (a CPU copy of x takes it)."""
    x_fp8, scale = fp8.quantize_per_token(x.cpu(), group)
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
    assert float(got_scale[1]) == float(torch.tensor(MIN_SCALE))  # in fp32


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
    assert_product(got, x_fp8.double() * x_scale.double(), w_fp8.double() * w_scale.double()[:, None], bias)


def assert_product(got: torch.Tensor, xd: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor) -> None:
    """`got` is xd wd^T + bias (float64 values of the FP8 operands) to the rounding of fp32 sums and of got's dtype."""
    product = xd @ wd.T
    # FP8 products are exact in fp32; each of the K = 96 fp32 additions rounds by 2^-24 of the sum so far, and the
    # output by one unit in its last place, for the product and for the bias added to it.
    accumulation = 96 * 2**-24 * (xd.abs() @ wd.abs().T)
    bound = torch.finfo(got.dtype).eps * (product.abs() + bias.double().abs()) + accumulation
    assert bool(((got.double() - (product + bias.double())).abs() <= bound).all())


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_fp8_linear_with_a_static_input_scale_multiplies_x_rounded_at_it(dtype):
    """A static checkpoint's activations: x / scale in fp32, clamped to +-448 (row 3, 50x the others, saturates),
    float8_e4m3fn, times the one scale; then the product as per token."""
    skip_unsupported(dtype)
    x, _, w_fp8, w_scale, bias = operands(dtype)
    scale = torch.tensor(4.0 / FP8_MAX, device=DEVICE)
    got = fp8.fp8_linear(x, w_fp8, w_scale, bias, input_scale=scale)
    assert got.dtype == dtype and got.shape == (5, 48)
    x_fp8 = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert bool((x.abs() > 4).any()) and float(x_fp8.float().abs().max()) == FP8_MAX
    assert_product(got, x_fp8.double() * scale.double(), w_fp8.double() * w_scale.double()[:, None], bias)
    torch.testing.assert_close(fp8.round_per_tensor(x, scale), (x_fp8.float() * scale).to(dtype), rtol=0, atol=0)
    # One token (a decode of one request): its scale is [1, 1] still with a stride along the row, as the product
    # requires.
    torch.testing.assert_close(fp8.fp8_linear(x[3:4], w_fp8, w_scale, bias, input_scale=scale), got[3:4])


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols, group", [(200, 64), (96, 48), (64, 128)])  # ragged last group; group past K
def test_the_kernel_quantizes_each_group_as_the_torch_path_does(dtype, cols, group):
    x = activations(7, cols, dtype, cols)
    x[3, min(group, cols) - 1] = 1e4  # one group of row 3 scaled far from its other groups
    got, got_scale = quantize_per_token(x, group)
    want, want_scale = torch_quantize(x, group)
    groups = -(-cols // group)
    assert got_scale.shape == (7, groups)
    assert torch.equal(got_scale.cpu(), want_scale.cpu()) and torch.equal(got.float().cpu(), want.float().cpu())
    # Each group's largest magnitude is 448: its scale is its own, not the row's.
    for g in range(groups):
        amax = got.float()[:, g * group : (g + 1) * group].abs().amax(dim=1)
        assert bool((amax[torch.arange(7) != 1] == FP8_MAX).all())
    assert float(got_scale[3, 0]) > 100 * float(got_scale[3, -1]) or groups == 1


def block_operands(dtype: torch.dtype, block: tuple[int, int], seed: int = 0):
    """x [5, 112] and a weight [72, 112] quantized per `block` tile (the edge tiles ragged), and a bias.
    Along K the weight's magnitudes fall 10^6-fold and x's rise as much, so every column adds about as much to
    the products, and the weight's rows differ 1000-fold."""
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(5, 112, generator=gen)
        * torch.tensor([[0.01], [1.0], [3.0], [50.0], [0.5]])
        * torch.logspace(-3, 3, 112)
    )
    w = torch.randn(72, 112, generator=gen) * torch.logspace(-2, 1, 72)[:, None] * torch.logspace(3, -3, 112)
    x = x.to(dtype)
    w_fp8, w_scale = quantize_tiles(w, block)
    bias = torch.randn(72, generator=gen).to(dtype)
    return x.to(DEVICE), w, w_fp8.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE)


def block_product(x, w_fp8, w_scale, block, bias):
    """The block kernel: fp8_linear on CUDA, called directly on CPU (where fp8_linear takes the torch path)."""
    if DEVICE == "cuda":
        return fp8.fp8_linear(x, w_fp8, w_scale, bias, block)
    x_fp8, x_scale = quantize_per_token(x, block[1])
    return block_scaled_mm(x_fp8, x_scale, w_fp8, w_scale, block, bias, x.dtype)


BLOCKS = [(32, 96), (48, 32), (128, 128)]  # ragged tiles; the smallest step; the published checkpoints' (one tile)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_block_kernel_is_the_product_of_the_values_its_operands_stand_for(dtype, block):
    x, _, w_fp8, w_scale, bias = block_operands(dtype, block)
    x_fp8, x_scale = torch_quantize(x, block[1])
    rows, cols = block
    xd = x_fp8.double().cpu() * x_scale.double().cpu().repeat_interleave(cols, dim=1)[:, :112]
    wd = (
        w_fp8.double().cpu()
        * w_scale.double().cpu().repeat_interleave(rows, 0)[:72].repeat_interleave(cols, 1)[:, :112]
    )
    product = xd @ wd.T + bias.double().cpu()
    # Each step's FP8 products are exact in fp32; the steps' sums and scalings round by 2^-24 of what they add.
    bound = torch.finfo(dtype).eps * product.abs() + 112 * 2**-23 * (xd.abs() @ wd.abs().T) + 1e-30
    for got in (
        block_product(x, w_fp8, w_scale, block, bias),
        fp8.block_fp8_linear(x.cpu(), w_fp8.cpu(), w_scale.cpu(), block, bias.cpu()),
    ):
        assert got.dtype == dtype and got.shape == (5, 72)
        assert bool(((got.double().cpu() - product).abs() <= bound).all())


@pytest.mark.parametrize("block", [(48, 32), (16, 32)])  # groups narrow enough for the spread along K
def test_tile_scales_keep_small_tiles_finer_than_row_scales_would(block):
    """Along each row the weight spans 10^6 (and x as much the other way), beyond FP8's range (448 down to 2^-9):
    one scale per token and per weight row flushes the small ends of both to zero or a coarse subnormal grid,
    where a scale per tile and group keeps every part to FP8's relative precision."""
    x, w, w_fp8, w_scale, _ = block_operands(torch.float32, block, seed=1)
    got = block_product(x, w_fp8, w_scale, block, None).double().cpu()
    xd, wd = x.double().cpu(), w.double()
    exact = xd @ wd.T
    bound = (2**-3 + 2**-8) * (xd.abs() @ wd.abs().T) + torch.finfo(torch.float32).eps * exact.abs()
    assert bool(((got - exact).abs() <= bound).all())
    rows_fp8, rows_scale = fp8.quantize_per_token(w)  # the same weight with one scale per row
    by_rows = fp8.fp8_linear(x.cpu(), rows_fp8, rows_scale.view(-1)).double()
    assert float((got - exact).norm()) < 0.5 * float((by_rows - exact).norm())
