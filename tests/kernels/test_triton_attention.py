"""The Triton kernels against the torch path: compiled on CUDA when there is a GPU, else on CPU
tensors under the Triton interpreter."""

import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # @triton.jit reads this when it decorates, triton's own library included, so it must be set
    # before triton's first import; on CPU nothing else in the suite uses triton.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
    )
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import TorchBackend, default_block_size, flash_attention, select_backend  # noqa: E402
from kernels.flash_attention import FlashAttnBackend  # noqa: E402
from kernels.triton_attention import TritonBackend  # noqa: E402
from tests.kernels.reference import POISON, make_batch, to_fp8  # noqa: E402

SCALE = 0.25

CASES = {
    "decode_only": ([1] * 5, [1, 8, 9, 31, 70]),
    "mixed": ([1, 12, 1, 7, 21], [45, 12, 17, 30, 21]),
    "long_chunk_after_context": ([70], [100]),
    # contexts over one 128-key partition: decode-only steps split each context and merge the partitions
    "split_decode": ([1] * 4, [1100, 513, 7, 1024]),
}


def max_error_against_torch_path(batch):
    batch = batch.to(DEVICE)
    triton_backend, torch_backend = TritonBackend(), TorchBackend()
    out = triton_backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(triton_backend), SCALE)
    expected = torch_backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(torch_backend), SCALE)
    return float((out - expected).abs().max())


HEADS = [(2, 1), (3, 3), (1, 4)]  # (kv_heads, group)
BLOCK_SIZES = [8, 16, 32]
# Compiled on CUDA, every combination. Under the interpreter each costs seconds (~130 s for all 36 on 2 cores): a
# Latin square still meets every pair of case, heads and block size, in 12.
GRID = (
    [(c, *h, b) for c in CASES for h in HEADS for b in BLOCK_SIZES]
    if DEVICE == "cuda"
    else [(c, *h, BLOCK_SIZES[(i + j) % 3]) for i, c in enumerate(CASES) for j, h in enumerate(HEADS)]
)


@pytest.mark.parametrize(("case", "kv_heads", "group", "block_size"), GRID)
def test_paged_attention_matches_torch_path(case, kv_heads, group, block_size):
    q_lens, seq_lens = CASES[case]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group)
    assert max_error_against_torch_path(batch) <= 1e-4


@pytest.mark.parametrize("case", ["mixed", "long_chunk_after_context", "split_decode"])
def test_sliding_window_matches_torch_path(case):
    q_lens, seq_lens = CASES[case]
    batch = make_batch(q_lens, seq_lens, block_size=16, kv_heads=2, group=2).to(DEVICE)
    triton_backend, torch_backend = TritonBackend(), TorchBackend()
    # 600 keys: the split decode's first partition is cut, and a 1100-key context's first one is past the window.
    for window in (5, 40, 600):
        out = triton_backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(triton_backend), SCALE, window)
        expected = torch_backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(torch_backend), SCALE, window)
        assert float((out - expected).abs().max()) <= 1e-4


def test_long_decodes_take_the_split_path_and_match_unsplit(monkeypatch):
    from kernels import triton_attention

    batch = make_batch([1] * 3, [1100, 600, 9], block_size=16, kv_heads=2, group=4).to(DEVICE)
    backend = TritonBackend()
    calls = []
    split = backend._split_decode
    monkeypatch.setattr(backend, "_split_decode", lambda *a: calls.append(a[4:6]) or split(*a))
    out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)
    assert calls == [(128, 16)]  # cdiv(1100, 128) = 9 partitions, bucketed to 16 (the last 7 past every context)
    monkeypatch.setattr(triton_attention, "_SPLIT_BELOW_PROGRAMS", 0)
    whole = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)
    assert calls == [(128, 16)] and float((out - whole).abs().max()) <= 1e-5


def test_a_context_within_one_partition_is_not_split(monkeypatch):
    batch = make_batch([1] * 2, [128, 40], block_size=16, kv_heads=1, group=2).to(DEVICE)
    backend = TritonBackend()
    monkeypatch.setattr(backend, "_split_decode", lambda *a: pytest.fail("split a context of one partition"))
    backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)


@pytest.mark.parametrize(
    "max_seq_len,plan",
    [
        (129, (128, 2)),
        (513, (128, 8)),
        (1025, (128, 16)),
        (8192, (128, 64)),
        (8193, (256, 64)),
        (9000, (256, 64)),
        (131072, (2048, 64)),
    ],
)
def test_split_plan_keeps_partitions_of_128_keys_until_64_of_them_hold_the_context(max_seq_len, plan):
    from kernels.triton_attention import split_plan

    assert split_plan(max_seq_len) == plan


def test_more_partitions_than_the_merge_reads_at_once_match_the_torch_path():
    # 9,000 keys: 36 partitions of 256, bucketed to 64, merged 16 at a time (four steps of the running max).
    batch = make_batch([1, 1], [9000, 700], block_size=32, kv_heads=1, group=2, head_dim=16)
    assert max_error_against_torch_path(batch) <= 1e-4


@pytest.mark.parametrize("kernel_name", ["_paged_decode_split_kernel", "_merge_splits_kernel"])
def test_split_count_is_a_run_time_argument(kernel_name):
    """A constexpr split count (or one Triton specialises on) recompiled both kernels each time the longest
    context crossed a partition boundary."""
    from triton.runtime.jit import JITFunction

    from kernels import triton_attention

    kernel = getattr(triton_attention, kernel_name)
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    params = {p.name: p for p in jit.params}
    assert not params["num_splits"].is_constexpr and params["num_splits"].do_not_specialize
    assert not any("SPLITS_PAD" in name or name == "NUM_SPLITS" for name in params)


def test_paged_attention_handles_head_dim_below_the_tile():
    batch = make_batch([3, 1], [11, 6], block_size=16, kv_heads=2, group=3, head_dim=24)
    assert max_error_against_torch_path(batch) <= 1e-4


def test_store_kv_matches_torch_path_and_touches_nothing_else():
    num_blocks, block_size, kv_heads, head_dim = 5, 8, 3, 16
    engine_cache = torch.full((2, 2, num_blocks, block_size, kv_heads, head_dim), POISON, device=DEVICE)
    expected = engine_cache.clone()
    slots = torch.tensor([9, 8, 31, 17, 39, 10], device=DEVICE)
    qkv = torch.randn(len(slots), 3, kv_heads, head_dim, device=DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views, as the model passes them
    TritonBackend().store_kv(k, v, engine_cache[:, 1], slots)
    TorchBackend().store_kv(k, v, expected[:, 1], slots)
    assert torch.equal(engine_cache, expected)


def test_fp8_store_kv_writes_the_torch_paths_bytes():
    cache = torch.zeros(2, 5, 8, 3, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    expected = cache.clone()
    slots = torch.tensor([9, 8, 31, 17, 39, 10], device=DEVICE)
    # Values on FP8's grid times their scales, and some past 448 times them (saturated): the bytes do not hang on
    # the cast's rounding, which the interpreter gets wrong across a power of two (124.6 -> 64, not 128). The grid's
    # values are clamped first: torch before 2.13 casts a value past 448 to NaN.
    k, v = (torch.randn(2, len(slots), 3, 16) * 300).clamp(-448, 448).to(torch.float8_e4m3fn).float().to(DEVICE)
    k, v = k * 0.5, v * 2.0
    v[0, 0, :4] = torch.tensor([1000.0, -1000.0, 3000.0, -3000.0])
    TritonBackend().store_kv(k, v, cache, slots, k_scale=0.5, v_scale=2.0)
    TorchBackend().store_kv(k, v, expected, slots, k_scale=0.5, v_scale=2.0)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(("q_lens", "seq_lens"), [CASES["mixed"], ([1, 1], [300, 40])], ids=["mixed", "split"])
def test_fp8_pages_match_the_torch_path(q_lens, seq_lens):
    batch = make_batch(q_lens, seq_lens, block_size=16, kv_heads=2, group=2)
    fp8, _ = to_fp8(batch, 0.5, 2.0)
    fp8 = fp8.to(DEVICE)
    triton_backend, torch_backend = TritonBackend(), TorchBackend()
    scales = {"k_scale": 0.5, "v_scale": 2.0}
    out = triton_backend.paged_attention(fp8.q, fp8.kv_cache, fp8.metadata(triton_backend), SCALE, **scales)
    expected = torch_backend.paged_attention(fp8.q, fp8.kv_cache, fp8.metadata(torch_backend), SCALE, **scales)
    assert float((out - expected).abs().max()) <= 1e-4


# Selection on CUDA only builds backend objects, so it can be checked on any machine.
FLASH_STAND_INS = (lambda *args, **kwargs: None, lambda *args, **kwargs: None)


@pytest.mark.parametrize(
    "flash_attn_imports,block_size,dtype,expected",
    [
        (True, None, None, FlashAttnBackend),
        (True, 256, torch.bfloat16, FlashAttnBackend),
        (True, 16, None, TritonBackend),
        (True, 256, torch.float32, TritonBackend),
        (True, None, torch.float32, TritonBackend),
        (True, 256, torch.float8_e4m3fn, TritonBackend),  # FP8 pages (--kv-cache-dtype fp8)
        (False, None, None, TritonBackend),
    ],
)
def test_auto_on_cuda_prefers_flash_attn_then_triton(monkeypatch, flash_attn_imports, block_size, dtype, expected):
    monkeypatch.setattr(flash_attention, "load_flash_attn", lambda: FLASH_STAND_INS if flash_attn_imports else None)
    backend = select_backend("auto", "cuda", block_size=block_size, dtype=dtype)
    assert type(backend) is expected
    assert not isinstance(backend, FlashAttnBackend) or isinstance(backend.fallback, TritonBackend)


def test_flash_attn_on_cuda_without_the_package_is_refused(monkeypatch):
    monkeypatch.setattr(flash_attention, "load_flash_attn", lambda: None)
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", "cuda")
    assert isinstance(select_backend("triton", "cuda"), TritonBackend)


@pytest.mark.parametrize(
    "name,device,dtype,flash_attn_imports,expected",
    [
        ("auto", "cuda", None, True, 256),
        ("auto", "cuda", torch.bfloat16, True, 256),
        ("auto", "cuda", torch.float32, True, 16),
        ("auto", "cuda", torch.float8_e4m3fn, True, 16),
        ("auto", "cuda", None, False, 16),
        ("flash_attn", "cuda", None, False, 256),
        ("triton", "cuda", None, True, 16),
        ("auto", "cpu", None, True, 16),
    ],
)
def test_default_block_size_suits_the_backend_auto_picks(
    monkeypatch, name, device, dtype, flash_attn_imports, expected
):
    monkeypatch.setattr(flash_attention, "load_flash_attn", lambda: FLASH_STAND_INS if flash_attn_imports else None)
    assert default_block_size(name, device, dtype) == expected
    if name == "auto":
        chosen = select_backend(name, device, expected, dtype)
        assert (chosen.name == "flash_attn") == (expected == 256)


def test_table_width_is_not_a_specialisation_key():
    """Triton specialises int arguments divisible by 16; the table's row stride (its width) must not be one,
    or the first step whose table width is a multiple of 16 compiles the kernel again while serving."""
    from triton.runtime.jit import JITFunction

    from kernels.triton_attention import _paged_attention_kernel

    kernel = _paged_attention_kernel
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    params = {p.name: p for p in jit.params}
    assert params["stride_table"].do_not_specialize
    assert not params["stride_qt"].do_not_specialize  # fixed per model: specialising on it is free
