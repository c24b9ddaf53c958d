"""The fused Triton kernels (RMSNorm with the residual add, SiLU-and-product, RoPE with the KV store) against
torch's ops, and a tiny Llama and Qwen3 through them against transformers: compiled on CUDA when there is a GPU,
else on CPU tensors under the Triton interpreter."""

import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # As in test_triton_attention.py: @triton.jit reads this when it decorates.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
    )
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import TorchBackend, fused  # noqa: E402
from kernels.triton_fused import rms_norm, rotary_store_kv, silu_and_mul  # noqa: E402
from tests.kernels.reference import POISON  # noqa: E402

DTYPES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(got: torch.Tensor, expected: torch.Tensor, factor: float = 1.0) -> None:
    """Within the dtype's tolerance times `factor`, relative to the largest expected value past 1."""
    scale = max(1.0, float(expected.float().abs().max()))
    assert float((got.float() - expected.float()).abs().max()) <= DTYPES[expected.dtype] * factor * scale


def assert_rounded_alike(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, but for the interpreter's bf16 casts, which truncate where CUDA rounds to nearest: one unit in the
    last place there (8 bits of mantissa)."""
    if DEVICE == "cpu" and got.dtype == torch.bfloat16:
        assert bool(((got.float() - expected.float()).abs() <= expected.float().abs() / 128).all())
    else:
        assert torch.equal(got, expected)


def strided_rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A [rows, cols] view with a row stride wider than its columns, as a split of a fused product gives."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols + 8, generator=gen).to(dtype)[:, 3 : 3 + cols].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 96])
def test_add_rms_norm_matches_torch_and_updates_the_residual(dtype, width):
    x = strided_rows(5, width, dtype, 0)
    residual = torch.randn(5, width).to(dtype).to(DEVICE)
    weight = (torch.rand(width) + 0.5).to(dtype).to(DEVICE)
    expected_sum = residual + x
    expected = weight * F.rms_norm(expected_sum.float(), (width,), eps=1e-5).to(dtype)
    x_before = x.clone()
    out = rms_norm(x, weight, 1e-5, residual)
    assert_rounded_alike(residual, expected_sum)
    assert torch.equal(x, x_before)
    assert_close(out, expected, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_a_residual_matches_torch(dtype):
    x = strided_rows(3, 80, dtype, 1)
    weight = (torch.rand(80) + 0.5).to(dtype).to(DEVICE)
    expected = weight * F.rms_norm(x.float(), (80,), eps=1e-6).to(dtype)
    assert_close(rms_norm(x, weight, 1e-6), expected, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("units", [100, 1500])  # one partial program a row; two, the second partial
def test_silu_and_mul_matches_torch(dtype, units):
    x = strided_rows(4, 2 * units, dtype, 2)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate.float()).to(dtype) * up
    assert_close(silu_and_mul(x), expected)


def reference_rotary_store(qk, v, cos, sin, cache, slots, heads, qk_norm, scales):
    """Queries, and a cache written as the model did before the fusion: per-head norms, rotary, torch's store."""
    qk = qk.clone()
    if qk_norm is not None:
        qw, kw, eps = qk_norm
        qk = torch.cat((F.rms_norm(qk[:, :heads], qw.shape, qw, eps), F.rms_norm(qk[:, heads:], kw.shape, kw, eps)), 1)
    x1, x2 = qk.chunk(2, dim=-1)
    qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    TorchBackend().store_kv(qk[:, heads:], v, cache, slots, *scales)
    return qk[:, :heads]


def rotary_case(dtype, head_dim, qk_norm, cache_dtype=None):
    heads, kv_heads, tokens = 4, 2, 6
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided views, as the model passes them
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    norms = None
    if qk_norm:
        qw, kw = (torch.rand(head_dim, generator=gen) + 0.5 for _ in range(2))
        norms = (qw.to(dtype).to(DEVICE), kw.to(dtype).to(DEVICE), 1e-6)
    # Torch before 2.13 casts a value past FP8's range to NaN rather than its largest: an FP8 cache's poison is that.
    poison = POISON if cache_dtype is None else torch.finfo(cache_dtype).max
    cache = torch.full((2, 5, 8, kv_heads, head_dim), poison, dtype=dtype).to(cache_dtype or dtype).to(DEVICE)
    slots = torch.tensor([9, 8, 31, 17, 39, 10], device=DEVICE)
    return qk, v, cos, sin, cache, slots, heads, norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 24])  # 24: a half of 12 lanes in a tile of 16
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3 q/k norm"])
def test_rotary_store_kv_matches_the_unfused_path(dtype, head_dim, qk_norm):
    qk, v, cos, sin, cache, slots, heads, norms = rotary_case(dtype, head_dim, qk_norm)
    expected_cache = cache.clone()
    expected_q = reference_rotary_store(qk, v, cos, sin, expected_cache, slots, heads, norms, (1.0, 1.0))
    q = rotary_store_kv(qk, v, cos, sin, cache, slots, 1.0, 1.0, norms)
    factor = 8 if qk_norm else 2
    assert_close(q, expected_q, factor)
    assert q.data_ptr() == qk.data_ptr()  # rotated in place
    written = torch.zeros(5 * 8, dtype=torch.bool)
    written[slots.cpu()] = True
    written = written.view(5, 8)
    assert torch.equal(cache[:, ~written], expected_cache[:, ~written])  # nothing else touched
    assert_close(cache, expected_cache, factor)


def test_rotary_store_kv_writes_fp8_pages_as_the_torch_store_does():
    qk, v, cos, sin, cache, slots, heads, _ = rotary_case(torch.float32, 32, False, torch.float8_e4m3fn)
    # Keys and values on FP8's grid times their scales after rotation would need the rotation undone: compare
    # dequantized values within FP8's rounding instead (3 mantissa bits: 1/16 relative, and the saturation).
    expected_cache = cache.clone()
    reference_rotary_store(qk, v, cos, sin, expected_cache, slots, heads, None, (0.5, 2.0))
    rotary_store_kv(qk, v, cos, sin, cache, slots, 0.5, 2.0, None)
    got, expected = cache.float(), expected_cache.float()
    assert float((got - expected).abs().max()) <= float(expected.abs().max()) / 8
    assert float(got.abs().max()) <= torch.finfo(torch.float8_e4m3fn).max


def test_the_dispatch_names_why_it_runs_unfused(monkeypatch, caplog):
    x = torch.randn(2, 8)
    assert fused._unfused_reason((x,)) is None
    assert "float64" in fused._unfused_reason((x.double(),))
    assert "strided" in fused._unfused_reason((x.t(),))
    monkeypatch.setenv("RAYLM_FUSED_KERNELS", "0")
    assert fused._unfused_reason((x,)) == "RAYLM_FUSED_KERNELS=0"
    monkeypatch.setattr(fused, "_logged", set())
    assert not fused._use_triton("rms_norm", x)  # a CPU tensor: its own ops, nothing to say
    with caplog.at_level(logging.WARNING, logger="kernels.fused"):
        assert not fused._triton_takes("rms_norm", (x,), None)
        assert not fused._triton_takes("rms_norm", (x,), None)
        monkeypatch.delenv("RAYLM_FUSED_KERNELS")
        assert fused._triton_takes("silu_and_mul", (x,), fused._not_2d(x))
        assert not fused._triton_takes("silu_and_mul", (x[None],), fused._not_2d(x[None]))
    assert [r.getMessage() for r in caplog.records] == [
        "raylm: rms_norm runs unfused on CUDA: RAYLM_FUSED_KERNELS=0",
        "raylm: silu_and_mul runs unfused on CUDA: a 3-D input of shape [1, 2, 8] (the kernel takes [tokens, width])",
    ]


@pytest.mark.skipif(DEVICE == "cuda", reason="tests/gpu/test_engine.py compares the families on CUDA")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_tiny_model_through_the_fused_kernels_matches_transformers(tiny_model_dir, monkeypatch, model_type):
    """On CPU the dispatch takes the Triton kernels (the interpreter's) as it does on CUDA: the model's wiring of
    them (which tensor is the residual, the q/k norms' weights, the cache's halves) against transformers."""
    from raylm import SamplingParams
    from tests.workers.test_families import transformers_greedy
    from tests.workers.test_model_runner import engine, prompts, run

    used = []

    def use_triton(op, *tensors, why_not=None):
        used.append(op)
        return fused._triton_takes(op, tensors, why_not)

    monkeypatch.setattr(fused, "_use_triton", use_triton)
    path = tiny_model_dir(model_type)
    ids = prompts(2)
    eng = engine(path, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    got = run(eng, ids, [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2)
    assert got == transformers_greedy(path, ids, 6)
    assert {"rms_norm", "add_rms_norm", "silu_and_mul", "rotary_store_kv"} <= set(used)
