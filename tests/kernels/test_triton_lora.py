"""The Triton batched LoRA op against the torch path (kernels/lora.py), under the Triton interpreter on CPU."""

import os
import sys

import numpy as np
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # As in test_triton_attention.py: @triton.jit reads this when it decorates, so before triton's first import.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
    )
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.lora import LoraBatch, add_lora  # noqa: E402
from kernels.triton_lora import triton_add_lora  # noqa: E402


@pytest.mark.parametrize(
    "slots",
    [[0, 0, 0], [2, -1, 0, 2, 1, -1, 1], [-1, -1]],
    ids=["one adapter", "three adapters and the base mixed", "base only"],
)
def test_triton_lora_matches_torch(slots):
    """A q/k/v-like layer: two fused outputs (sizes 80 and 24, the second at column 80) of rank 8, 3 slots."""
    g = torch.Generator().manual_seed(0)
    rank, k, sizes, offsets = 8, 72, [80, 24], [0, 80]
    x = torch.randn(len(slots), k, generator=g)
    lora_a = torch.randn(3, 2 * rank, k, generator=g)
    lora_bs = [torch.randn(3, rank, n, generator=g) for n in sizes]
    y0 = torch.randn(len(slots), sum(sizes) + 8, generator=g)  # 8 columns past the layer's outputs: untouched
    expected = y0.clone()
    batch = LoraBatch([])
    batch.set(np.array(slots))
    add_lora(expected, x, lora_a, lora_bs, offsets, batch)
    y = y0.to(DEVICE)
    to = [t.to(DEVICE) for t in (x, lora_a, torch.tensor(slots))]
    triton_add_lora(y, to[0], to[1], [b.to(DEVICE) for b in lora_bs], offsets, to[2])
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-4)
    if -1 in slots:
        base_rows = [i for i, s in enumerate(slots) if s < 0]
        assert torch.equal(y.cpu()[base_rows], y0[base_rows])


@pytest.mark.skipif(DEVICE == "cuda", reason="tests/gpu/test_features.py runs LoRA engines on CUDA")
def test_an_engine_on_the_cuda_wiring_matches_peft(lora_adapters):
    """The runner as it is on CUDA: each token's slot written with the step's inputs into a buffer that keeps its
    address (copied between CPU tensors here), and every LoRA layer running the Triton op (the interpreter's) on
    it at the step's token count, base-only steps included. Mixed adapters and the base against peft."""
    from tests.workers.test_lora import lora_engine, run
    from tests.workers.test_model_runner import copying_buffers

    base, paths, prompts, expected = lora_adapters
    engine = lora_engine(base, paths, max_loras=2)
    runner = engine.worker.runner
    copying_buffers(runner, token_slots=True)
    runner.lora.batch.token_slots = runner.buffers.dev["token_slots"]
    mixed = [(name, p) for p in prompts[:2] for name in (None, "attn8", "all4")]
    assert run(engine, mixed) == [expected[name][prompts.index(p)] for name, p in mixed]
    assert run(engine, [(None, prompts[0])]) == [expected[None][0]]
    assert not runner.lora.batch.runs  # the torch path's view was never built
