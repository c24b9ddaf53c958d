"""FP8 products (W8A8) on CUDA: an engine of the default model with quantization="fp8" in bf16 holds float8 weights
in its linear layers, captures its decodes with FP8 products inside, and decodes greedily near the bf16 engine; an
engine of the default model quantized into a block-scaled checkpoint (64x64 tiles, as Qwen3-FP8 and DeepSeek-V3
publish theirs at 128x128) does the same through the Triton block kernel; and one quantized per tensor with static
activations (RedHatAI's Llama-3.1-8B-Instruct-FP8 layout) decodes one request alone too, by the size-1 graph."""

import pytest
import torch

from tests.gpu.test_engine import cuda_engine, greedy, run_and_free
from tests.workers.fp8 import SCHEMES, Scheme, write_fp8_checkpoint
from tests.workers.test_model_runner import prompts, run
from workers.layers import ColumnParallelLinear, RowParallelLinear

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)  # conftest: CUDA only
# Greedy tokens before the first divergence from bf16, on average over the prompts. FP8 rounds every product's
# operands to 3 mantissa bits (bf16's have 8), so a near-tie between two tokens flips sooner: on CPU, SmolLM2's
# weights in bf16 kept 2 of 4 of these prompts equal over 24 tokens (the others diverged at their second token),
# and random weights of its shape (RAYLM_GPU_MODEL) have closer ties. Broken products (a wrong scale, a transposed
# weight) diverge at once.
MIN_MEAN_AGREEMENT = 2

pytestmark = pytest.mark.skipif(
    CAPABILITY < (8, 9), reason=f"FP8 products need compute capability 8.9 or above, this GPU is {CAPABILITY}"
)


def fp8_linears(engine) -> list[torch.nn.Module]:
    linears = [m for m in engine.worker.model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert engine.worker.runner.decode_graphs.graphs, "no decode graph was captured with FP8 products"
    return linears


def assert_near_bf16(engine, default_model_dir: str) -> None:
    ids = prompts(8)
    got = run_and_free(engine, ids, greedy(8, 32))
    want = run_and_free(cuda_engine(default_model_dir, dtype="bfloat16"), ids, greedy(8, 32))
    first = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    print(f"\nFP8 products' first divergence from bf16 greedy, per prompt (32 = none): {first}")
    assert all(len(g) == 32 for g in got)
    assert sum(first) / len(first) >= MIN_MEAN_AGREEMENT


def test_quantization_fp8_runs_fp8_products_near_the_bf16_engine(default_model_dir):
    engine = cuda_engine(default_model_dir, dtype="bfloat16", quantization="fp8")
    assert all(m.weight_scale.shape == (m.weight.shape[0],) and m.weight_block is None for m in fp8_linears(engine))
    assert_near_bf16(engine, default_model_dir)


def test_a_block_scaled_checkpoint_runs_the_block_kernel_near_the_bf16_engine(default_model_dir, tmp_path):
    """SmolLM2's shapes (q 576 rows, k and v 192, MLP 1536) are multiples of 64: every fused part starts on a tile."""
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
    write_fp8_checkpoint(default_model_dir, tmp_path, Scheme(config, (64, 64), "weight_scale_inv"))
    engine = cuda_engine(str(tmp_path), dtype="bfloat16")
    for m in fp8_linears(engine):
        assert m.weight_block == (64, 64) and m.weight_scale.shape == (m.weight.shape[0] // 64, m.weight.shape[1] // 64)
    assert_near_bf16(engine, default_model_dir)


def test_a_static_per_tensor_checkpoint_decodes_one_request_and_a_batch_near_the_bf16_engine(
    default_model_dir, tmp_path
):
    """One weight scale and one calibrated input scale a layer. A decode of one request is the one-token product
    whose activation scale once had strides (0, 0), which _scaled_mm's row-wise check refuses in some builds: its
    size-1 graph's capture (and with it every graph) failed, then every such decode."""
    write_fp8_checkpoint(default_model_dir, tmp_path, SCHEMES["fp8 per tensor (static activations)"])
    engine = cuda_engine(str(tmp_path), dtype="bfloat16")
    assert all(m.input_scale is not None for m in fp8_linears(engine))
    assert (1, 1) in engine.worker.runner.decode_graphs.graphs
    assert [len(t) for t in run(engine, prompts(1), greedy(1, 8))] == [8]
    assert_near_bf16(engine, default_model_dir)
