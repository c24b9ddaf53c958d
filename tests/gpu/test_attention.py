"""The CUDA attention kernels in bf16 and fp16 against a float64 reference: GQA groups 1/4/8, head_dim 64
and 128, contexts to 8k, decode-only, mixed and chunked-prefill batches."""

import dataclasses

import pytest
import torch

from kernels.flash_attention import PAGE_BLOCK_MULTIPLE, load_flash_attn
from kernels.triton_attention import TritonBackend, _paged_attention_kernel
from tests.kernels.reference import make_batch, naive_attention

CASES = {
    "decode": ([1] * 6, [1, 17, 255, 1000, 4097, 8192]),
    "mixed": ([1, 300, 1, 64, 1], [8000, 300, 513, 2100, 33]),
    "chunked_after_8k_context": ([512], [8192]),
}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # output rounding to the dtype, |out| < ~3


def backends():
    yield "triton", TritonBackend()
    functions = load_flash_attn()
    if functions is not None:
        from kernels.flash_attention import FlashAttnBackend

        yield "flash_attn", FlashAttnBackend(*functions, fallback=TritonBackend())


def float64_reference(batch, scale):
    exact = dataclasses.replace(batch, q=batch.q.double(), kv_cache=batch.kv_cache.double())
    return naive_attention(exact, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_against_float64(case, group, head_dim, dtype):
    q_lens, seq_lens = CASES[case]
    scale = head_dim**-0.5
    for name, backend in backends():
        block_size = PAGE_BLOCK_MULTIPLE if name == "flash_attn" else 16
        batch = make_batch(
            q_lens, seq_lens, block_size=block_size, kv_heads=2, group=group, head_dim=head_dim, dtype=dtype
        ).to("cuda")
        out = backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), scale)
        error = float((out.double() - float64_reference(batch, scale)).abs().max())
        assert error <= TOLERANCE[dtype], f"{name}: max error {error:.3g}"


def test_triton_compiles_once_across_table_widths():
    backend = TritonBackend()
    sizes = []
    for width in (15, 16, 17, 32):  # 16 and 32: widths divisible by 16, which Triton would specialise on
        batch = make_batch([1, 1], [20, 33], block_size=16, kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16).to(
            "cuda"
        )
        tables = torch.zeros(2, width, dtype=torch.int32, device="cuda")
        tables[:, : batch.block_tables.shape[1]] = batch.block_tables
        batch = dataclasses.replace(batch, block_tables=tables)
        backend.paged_attention(batch.q, batch.kv_cache, batch.metadata(backend), 0.125)
        sizes.append(sum(len(cache) for cache, *_ in _paged_attention_kernel.device_caches.values()))
    assert sizes == [sizes[0]] * 4
