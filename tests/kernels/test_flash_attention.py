"""The flash-attn backend's argument plumbing, against CPU stand-ins for flash-attn 2's functions.

The stand-ins keep flash-attn's signatures, its paged-KV semantics (causal aligned bottom-right,
keys read through the block table) and the checks its CUDA code makes on what it is given.
"""

import pytest
import torch

from kernels import TorchBackend
from kernels.flash_attention import PAGE_BLOCK_MULTIPLE, FlashAttnBackend
from tests.kernels.reference import make_batch, naive_attention

SCALE = 0.2


def _attend_paged(q, k_cache, v_cache, table, seqlen_k, softmax_scale, causal, window_size):
    """q [seqlen_q, heads, d] of one sequence against its first seqlen_k paged keys; `window_size` (left, right)
    as flash-attn reads it: query i (aligned bottom-right) sees keys i + seqlen_k - seqlen_q - left .. + right."""
    page = k_cache.shape[1]
    positions = torch.arange(seqlen_k)
    blocks = table.long()[positions // page]
    keys, values = (cache[blocks, positions % page].float() for cache in (k_cache, v_cache))
    group = q.shape[1] // k_cache.shape[2]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * softmax_scale
    diagonal = torch.arange(q.shape[0])[:, None] + seqlen_k - q.shape[0]
    visible = torch.ones(q.shape[0], seqlen_k, dtype=torch.bool)
    if causal:
        visible &= positions[None, :] <= diagonal
    if window_size[0] >= 0:
        visible &= positions[None, :] >= diagonal - window_size[0]
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1))  # flash-attn outputs zeros for fully masked rows
    return torch.einsum("hqk,khd->qhd", weights, values).to(q.dtype)


def _check_paged_inputs(q, k_cache, v_cache, block_table):
    assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == v_cache.dtype == q.dtype
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert q.shape[-2] % k_cache.shape[2] == 0
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    assert block_table is not None, "this stand-in models the paged form only"
    assert (dropout_p, window_size[1], softcap, alibi_slopes, return_attn_probs) == (
        0.0,
        -1 if window_size[0] < 0 else 0,
        0.0,
        None,
        False,
    )
    _check_paged_inputs(q, k, v, block_table)
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    q_lens, k_lens = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
    assert cu_seqlens_q[-1] == q.shape[0] and len(q_lens) == len(k_lens) == block_table.shape[0]
    # flash-attn sizes its grid from these; too small silently drops queries or keys.
    assert max_seqlen_q >= max(q_lens) and max_seqlen_k >= max(k_lens)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    starts = cu_seqlens_q.tolist()
    return torch.cat(
        [
            _attend_paged(q[starts[b] : starts[b + 1]], k, v, block_table[b], k_lens[b], scale, causal, window_size)
            for b in range(len(q_lens))
        ]
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    assert block_table is not None, "this stand-in models the paged form only"
    assert (k, v, rotary_cos, cache_batch_idx, cache_leftpad, alibi_slopes) == (None,) * 6
    assert (window_size[1], softcap, return_softmax_lse) == (-1 if window_size[0] < 0 else 0, 0.0, False)
    _check_paged_inputs(q, k_cache, v_cache, block_table)
    assert q.dim() == 4 and cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.stack(
        [
            _attend_paged(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]), scale, causal, window_size)
            for b in range(q.shape[0])
        ]
    )


class Calls:
    """Wraps the stand-ins and records which one ran."""

    def __init__(self):
        self.names = []

    def __call__(self, fn):
        def recorded(*args, **kwargs):
            self.names.append(fn.__name__)
            return fn(*args, **kwargs)

        return recorded


@pytest.fixture
def calls():
    return Calls()


@pytest.fixture
def backend(calls):
    return FlashAttnBackend(calls(flash_attn_varlen_func), calls(flash_attn_with_kvcache), fallback=TorchBackend())


CASES = {
    # seq_lens around the 256-token page edge; q_lens mix decodes, a whole prompt and chunks after context
    "decode_only": ([1] * 5, [1, 255, 256, 257, 600], "flash_attn_with_kvcache"),
    "mixed": ([1, 40, 1, 7, 300], [300, 40, 513, 262, 300], "flash_attn_varlen_func"),
    "chunk_after_context": ([9], [520], "flash_attn_varlen_func"),
}


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (1, 4)])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_matches_reference_through_flash_attn(backend, calls, case, kv_heads, group):
    q_lens, seq_lens, expected_call = CASES[case]
    batch = make_batch(
        q_lens, seq_lens, block_size=PAGE_BLOCK_MULTIPLE, kv_heads=kv_heads, group=group, dtype=torch.float16
    )
    out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)
    assert calls.names == [expected_call] and out.dtype == torch.float16
    # fp16 inputs are exact in float64; the 2e-3 allowance is fp16 rounding of the output.
    torch.testing.assert_close(out.double(), naive_attention(batch, SCALE).double(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("case", ["decode_only", "chunk_after_context"])
def test_sliding_window_reaches_flash_attn(backend, calls, case):
    q_lens, seq_lens, expected_call = CASES[case]
    batch = make_batch(q_lens, seq_lens, block_size=PAGE_BLOCK_MULTIPLE, kv_heads=2, group=2, dtype=torch.float16)
    out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE, window=37)
    assert calls.names == [expected_call]
    torch.testing.assert_close(out.double(), naive_attention(batch, SCALE, 37).double(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("block_size,dtype", [(16, torch.float16), (PAGE_BLOCK_MULTIPLE, torch.float32)])
def test_unsupported_caches_fall_back_with_a_warning(backend, calls, block_size, dtype):
    batch = make_batch([1, 5], [20, 9], block_size=block_size, kv_heads=2, group=2, dtype=dtype)
    with pytest.warns(UserWarning, match="flash_attn cannot serve this KV cache"):
        out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)
    assert calls.names == []
    torch_backend = TorchBackend()
    expected = torch_backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(torch_backend), SCALE)
    assert torch.equal(out, expected)


def test_store_kv_goes_to_the_fallback(backend):
    batch = make_batch([2], [2], block_size=16, kv_heads=1, group=1)
    k, v = torch.randn(2, 2, 1, 32)
    backend.store_kv(k, v, batch.kv_cache, batch.slot_mapping)
    assert torch.equal(batch.kv_cache[0].view(-1, 1, 32)[batch.slot_mapping], k)
    assert torch.equal(batch.kv_cache[1].view(-1, 1, 32)[batch.slot_mapping], v)


@pytest.mark.parametrize(
    "version,supported",
    [
        ("2.8.3", True),
        ("2.6.0", True),
        ("2.7.4.post1", True),
        ("2.8.3.post1", True),
        ("2.9.0", False),
        ("2.5.9", False),
        ("3.0.0b1", False),
        ("unknown", False),
    ],
)
def test_only_reviewed_flash_attn_versions_are_supported(version, supported):
    from kernels.flash_attention import version_supported

    assert version_supported(version) == supported


@pytest.mark.parametrize("version", ["2.8.3", "2.9.1"])
def test_a_flash_attn_outside_the_supported_versions_is_not_used(monkeypatch, version):
    """A stand-in `flash_attn` package (the real one needs CUDA to import) of each version."""
    import sys
    import types

    from kernels.flash_attention import load_flash_attn

    package = types.ModuleType("flash_attn")
    package.__version__ = version
    package.flash_attn_varlen_func = package.flash_attn_with_kvcache = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    if version == "2.8.3":
        assert load_flash_attn() == (package.flash_attn_varlen_func, package.flash_attn_with_kvcache)
    else:
        with pytest.warns(UserWarning, match=r"flash_attn 2\.9\.1 is outside the versions raylm supports"):
            assert load_flash_attn() is None
