import pytest
import torch

from kernels import TorchBackend, select_backend
from kernels.torch_attention import _DecodeGroup
from tests.kernels.reference import POISON, make_batch, naive_attention, to_fp8

SCALE = 0.3

# (q_lens, seq_lens): decodes (q_len 1), whole prompts (q_len == seq_len) and prefill chunks after
# cached context, with lengths on both sides of block boundaries.
CASES = {
    "decode_only": ([1] * 6, [1, 7, 8, 9, 33, 64]),
    "one_whole_prompt": ([37], [37]),
    "one_chunk_after_context": ([20], [61]),
    "mixed": ([1, 16, 1, 5, 24, 1], [40, 16, 1, 21, 24, 17]),
    "many_short_prompts": ([3, 4, 2, 5, 1, 3], [3, 4, 6, 5, 9, 3]),
}


@pytest.mark.parametrize("native_decode", [True, False], ids=["native-decode", "sdpa-only"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (1, 4)])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_matches_naive_reference(case, kv_heads, group, block_size, native_decode):
    q_lens, seq_lens = CASES[case]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group)
    backend = TorchBackend(native_decode)
    out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)
    torch.testing.assert_close(out, naive_attention(batch, SCALE), rtol=0, atol=1e-5)


@pytest.mark.parametrize("native_decode", [True, False], ids=["native-decode", "sdpa-only"])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_matches_naive_reference(window, native_decode):
    # Contexts shorter and longer than the window; decodes, a whole prompt and chunks after context.
    q_lens, seq_lens = [1, 1, 1, 20, 6, 37], [3, 16, 40, 61, 21, 37]
    batch = make_batch(q_lens, seq_lens, block_size=8, kv_heads=2, group=2)
    backend = TorchBackend(native_decode)
    out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE, window)
    torch.testing.assert_close(out, naive_attention(batch, SCALE, window), rtol=0, atol=1e-5)


def test_requests_of_very_different_shapes_split_into_padded_groups():
    # Decodes spread over a wide range of contexts, and prefill chunks of different lengths, so
    # that the plan holds several groups and some padded query rows.
    q_lens = [1] * 12 + [3, 4, 30]
    seq_lens = [2, 5, 40, 90, 150, 151, 200, 260, 300, 301, 390, 400] + [20, 21, 70]
    batch = make_batch(q_lens, seq_lens, block_size=16, kv_heads=3, group=3, head_dim=16)
    backend = TorchBackend(native_decode=False)
    md = batch.metadata(backend)
    assert len(md.plan) > 2 and any(group.real is not None for group in md.plan)
    out = backend.paged_attention(batch.q, batch.kv_cache, md, SCALE)
    torch.testing.assert_close(out, naive_attention(batch, SCALE), rtol=0, atol=1e-5)


def test_native_kernel_attends_every_decode_in_one_call():
    q_lens = [1] * 12 + [3, 30]
    seq_lens = [2, 5, 40, 90, 150, 151, 200, 260, 300, 301, 390, 400] + [20, 70]
    batch = make_batch(q_lens, seq_lens, block_size=16, kv_heads=3, group=3, head_dim=64)
    backend = TorchBackend()
    assert backend._paged_decode is not None, "the native decode kernel did not build"
    md = batch.metadata(backend)
    decode_groups = [g for g in md.plan if isinstance(g, _DecodeGroup)]
    assert len(decode_groups) == 1 and decode_groups[0].tokens.tolist() == list(range(12))
    out = backend.paged_attention(batch.q, batch.kv_cache, md, SCALE)
    torch.testing.assert_close(out, naive_attention(batch, SCALE), rtol=0, atol=1e-5)


@pytest.mark.parametrize("head_dim", [20, 72, 96, 128])
@pytest.mark.parametrize("block_size", [5, 16])
def test_native_kernel_takes_any_head_dim_and_block_size(head_dim, block_size):
    # The kernel sums a head in chunks of vector registers and keys eight at a time: these head sizes leave a
    # scalar tail (20), one vector (72), half a chunk (96) or two chunks (128); blocks of 5 split every eight.
    q_lens, seq_lens = [1] * 6, [1, 8, 9, 23, 40, 131]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, kv_heads=2, group=3, head_dim=head_dim)
    backend = TorchBackend()
    assert backend._paged_decode is not None, "the native decode kernel did not build"
    for window in (None, 7):
        out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE, window)
        torch.testing.assert_close(out, naive_attention(batch, SCALE, window), rtol=0, atol=1e-5)


def test_decodes_of_a_cache_the_kernel_does_not_take_fall_back_to_sdpa():
    batch = make_batch([1, 1, 4], [9, 30, 12], block_size=8, kv_heads=2, group=2, dtype=torch.float64)
    backend = TorchBackend()
    out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)
    torch.testing.assert_close(out, naive_attention(batch, SCALE), rtol=0, atol=1e-9)


def test_attention_reads_keys_just_stored_by_store_kv():
    batch = make_batch([4, 1], [10, 5], block_size=8, kv_heads=2, group=2)
    k, v = torch.randn(2, 5, 2, 32)
    backend = TorchBackend()
    backend.store_kv(k, v, batch.kv_cache, batch.slot_mapping)
    out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), SCALE)
    torch.testing.assert_close(out, naive_attention(batch, SCALE), rtol=0, atol=1e-5)
    flat_keys = batch.kv_cache[0].view(-1, 2, 32)
    assert torch.equal(flat_keys[batch.slot_mapping], k)


def test_store_kv_writes_exactly_the_named_slots():
    num_layers, num_blocks, block_size, kv_heads, head_dim = 3, 6, 4, 2, 8
    engine_cache = torch.full((2, num_layers, num_blocks, block_size, kv_heads, head_dim), POISON)
    layer = engine_cache[:, 1]  # the view the model hands over: not contiguous across keys/values
    slots = torch.tensor([5, 4, 22, 9, 23, 12])
    qkv = torch.randn(len(slots), 3 * kv_heads * head_dim)  # k and v are strided views, as in the model
    k, v = (
        qkv[:, i * kv_heads * head_dim : (i + 1) * kv_heads * head_dim].view(-1, kv_heads, head_dim) for i in (1, 2)
    )
    TorchBackend().store_kv(k, v, layer, slots)

    expected = torch.full_like(engine_cache, POISON)
    for token, slot in enumerate(slots.tolist()):
        expected[0, 1, slot // block_size, slot % block_size] = k[token]
        expected[1, 1, slot // block_size, slot % block_size] = v[token]
    assert torch.equal(engine_cache, expected)


def test_fp8_pages_are_stored_divided_by_their_scales_and_read_back_times_them():
    batch = make_batch([1, 1, 5, 1], [9, 30, 12, 40], block_size=8, kv_heads=2, group=2)
    fp8, dequantized = to_fp8(batch, 0.5, 2.0)
    backend = TorchBackend()
    out = backend.paged_attention(batch.q, fp8.kv_cache, fp8.metadata(backend), SCALE, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out, naive_attention(dequantized, SCALE), rtol=0, atol=1e-5)
    # store_kv writes what to_fp8 stores, saturating at 448 (3000 / 2.0 for the first value)
    k, v = torch.randn(2, 8, 2, 32)
    v[0, 0, 0] = 3000.0
    cache = torch.zeros(2, 4, 8, 2, 32, dtype=torch.float8_e4m3fn)
    backend.store_kv(k, v, cache, torch.arange(8, 16), k_scale=0.5, v_scale=2.0)
    stored = cache.view(2, -1, 2, 32)[:, 8:16]
    assert torch.equal(stored[0].view(torch.uint8), (k / 0.5).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(stored[1].float(), (v / 2.0).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert float(stored[1, 0, 0, 0]) == 448.0


def test_build_runs_the_backends_plan_once():
    class CountingBackend(TorchBackend):
        plans = 0

        def plan(self, md):
            CountingBackend.plans += 1
            return super().plan(md)

    batch = make_batch([2, 1], [2, 9], block_size=8, kv_heads=1, group=1)
    backend = CountingBackend()
    md = batch.metadata(backend)
    for _ in range(3):
        backend.paged_attention(batch.q, batch.kv_cache, md, SCALE)
    assert CountingBackend.plans == 1


@pytest.mark.parametrize("name", ["auto", "torch"])
def test_select_backend_picks_torch_on_cpu(name):
    assert isinstance(select_backend(name, torch.device("cpu")), TorchBackend)


@pytest.mark.parametrize("name", ["triton", "flash_attn"])
def test_select_backend_refuses_gpu_backends_on_cpu(name):
    with pytest.raises(ValueError, match=name):
        select_backend(name, "cpu")


def test_select_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="flashinfer"):
        select_backend("flashinfer", "cpu")
