"""The fused Triton kernels in a CUDA decode step: how many kernels a layer launches with and without them, and
that the fused step decodes what the unfused one does."""

import random

import pytest

from bench.profile import profiled_steps, step_profile
from bench.throughput import start_decoding
from tests.gpu.test_engine import cuda_engine, free, greedy, run_and_free
from tests.workers.test_model_runner import prompts

# A layer of a decode step: its norm with the residual add, the q/k/v product, RoPE with the KV store, attention
# (a split decode and its merge), the output product, the second norm, gate/up, SiLU-and-product, down; cuBLAS may
# add a split-K reduction to a product.
MAX_FUSED_KERNELS_PER_LAYER = 12


def layer_kernels(path: str, fused: bool, monkeypatch) -> list[str]:
    """The kernels of one decoder layer in an eager bf16 decode step of one request."""
    monkeypatch.setenv("RAYLM_FUSED_KERNELS", "1" if fused else "0")
    engine = cuda_engine(path, dtype="bfloat16", enforce_eager=True)
    try:
        start_decoding(engine, 1, 64, 8, random.Random(0))
        found = step_profile(*profiled_steps(engine, 3, True, None), engine.spec.num_layers)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        free(engine)
    assert len(set(found.counts)) == 1, f"decode steps launched different kernel counts: {found.counts}"
    assert found.layer is not None, "no repeating layer of kernels was found"
    return found.layer[1]


def test_a_fused_decode_layer_launches_at_most_a_dozen_kernels(default_model_dir, monkeypatch):
    fused = layer_kernels(default_model_dir, True, monkeypatch)
    unfused = layer_kernels(default_model_dir, False, monkeypatch)
    print(f"kernels per layer: fused {len(fused)}, unfused {len(unfused)}")
    print("fused layer:\n  " + "\n  ".join(fused))
    print("unfused layer:\n  " + "\n  ".join(unfused))
    assert len(fused) <= MAX_FUSED_KERNELS_PER_LAYER
    assert len(fused) < len(unfused)


@pytest.mark.parametrize("model", ["default", "qwen3"])
def test_fused_and_unfused_decodes_agree(default_model_dir, tiny_model_dir, monkeypatch, model):
    """fp32: the same tokens with and without the fusions (the rounding is the same up to fp32's own), Qwen3's
    q/k norm inside the RoPE kernel included."""
    path = default_model_dir if model == "default" else tiny_model_dir("qwen3")
    ids = prompts(4)
    outs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("RAYLM_FUSED_KERNELS", fused)
        outs.append(run_and_free(cuda_engine(path, dtype="float32"), ids, greedy(4, 16)))
    assert outs[0] == outs[1]
