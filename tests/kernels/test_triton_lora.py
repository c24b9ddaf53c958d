"""The Triton batched LoRA op against the torch path (kernels/lora.py), under the Triton interpreter on CPU: tiles
of one adapter, of several, of the base model and past the step's end, every fused output in one launch."""

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

import triton  # noqa: E402

from kernels import triton_lora  # noqa: E402
from kernels.lora import LoraBatch, add_lora  # noqa: E402
from kernels.triton_lora import triton_add_lora  # noqa: E402

# The interpreter multiplies bfloat16's bit patterns in tl.dot (triton-lang/triton#11584): fp16 stands in there.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


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


SLOTS = {  # slot 0 is NaN: a base token's -1 read as slot 0 would show
    "one token": [2],
    "one adapter, the last tile past the step's end": [1] * 37,
    "adapters changing mid-tile": [1] * 10 + [2] * 13 + [3] * 9,
    "base tokens inside an adapter's tile, and whole base tiles": [-1] * 16 + [3] * 5 + [-1] * 3 + [3] * 8 + [-1] * 20,
    "a slot per token, the base among them": [3, -1, 1, 3, 2, -1, 2, 1] * 3,
    "base only": [-1] * 20,
}
# (rank, fused outputs' sizes): ragged column tiles; ranks below tl.dot's 16 (padded), not a power of two, the
# default max_lora_rank, one whose shrink is 192 wide (two dots' columns) and one whose expand takes two dots'.
LAYERS = {
    "rank 8, q/k/v-like": (8, [80, 24, 40]),
    "rank 12, gate/up-like": (12, [80, 24]),
    "rank 16, down-like": (16, [72]),
    "rank 64, q/k/v-like": (64, [80, 24, 40]),
    "rank 160, down-like": (160, [72]),  # wider than a dot takes: the shrink's columns and the expand's rank cut
}
K = 136  # x's width: a multiple of no reduction step, so each layer's last step is ragged


def make_layer(rank: int, sizes: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A and the Bs of 4 slots, scaled so the products stay near 1; slot 0, which no token uses, is NaN: a read
    of it would show in y."""
    g = torch.Generator().manual_seed(0)
    lora_a = torch.randn(4, len(sizes) * rank, K, generator=g) / K**0.5
    lora_bs = [torch.randn(4, rank, n, generator=g) / rank**0.5 for n in sizes]
    for w in (lora_a, *lora_bs):
        w[0] = float("nan")
    return lora_a.to(dtype), [b.to(dtype) for b in lora_bs]


def run_layer(slots: list[int], lora_a: torch.Tensor, lora_bs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(y0, y, x), in the weights' dtype: y0 a random [T, outputs], y the Triton op's result on y0 as a strided view
    of a wider buffer (whose other columns it checks untouched), x the op's input."""
    g = torch.Generator().manual_seed(1)
    sizes = [b.shape[2] for b in lora_bs]
    x = torch.randn(len(slots), K, generator=g).to(lora_a.dtype)
    buffer = torch.randn(len(slots), sum(sizes) + 24, generator=g).to(lora_a.dtype)
    y0 = buffer[:, 8:-8]  # 8 more columns past the outputs, and 8 before: untouched
    out = buffer.to(DEVICE, copy=True)
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    args = [t.to(DEVICE) for t in (x, lora_a, *lora_bs, torch.tensor(slots))]
    triton_add_lora(out[:, 8:-8], args[0], args[1], args[2:-1], offsets, args[-1])
    out = out.cpu()
    assert torch.equal(out[:, :8], buffer[:, :8]) and torch.equal(out[:, -8:], buffer[:, -8:])
    return y0.clone(), out[:, 8:-8], x


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("layer", LAYERS.values(), ids=LAYERS)
@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS)
def test_every_tile_matches_the_torch_path(slots, layer, dtype):
    """Against the torch path in fp32 on the same inputs: fp32 within 1e-5, halves within their rounding (the
    shrink's result rounds to the half before the expand, as the torch path's does); the base's rows exact."""
    rank, sizes = layer
    lora_a, lora_bs = make_layer(rank, sizes, dtype)
    y0, y, x = run_layer(slots, lora_a, lora_bs)
    expected = y0.float()
    batch = LoraBatch([])
    batch.set(np.array(slots))
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    add_lora(expected, x.float(), lora_a.float(), [b.float() for b in lora_bs], offsets, batch)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y[base_rows], y0[base_rows])


@pytest.mark.parametrize("layer", LAYERS.values(), ids=LAYERS)
def test_a_layer_is_two_launches(layer, monkeypatch):
    """A shrink over the token tiles and one expand over every fused output's column tiles, whatever the outputs."""
    launches = []
    kernel_type = type(triton_lora._expand_kernel)  # JITFunction, or the interpreter's stand-in
    launch = kernel_type.__getitem__

    def recorded(kernel, grid):
        launches.append((kernel, grid))
        return launch(kernel, grid)

    monkeypatch.setattr(kernel_type, "__getitem__", recorded)
    rank, sizes = layer
    run_layer(SLOTS["adapters changing mid-tile"], *make_layer(rank, sizes, torch.float32))
    token_tiles = triton.cdiv(32, triton_lora._BLOCK_M)
    column_tiles = sum(triton.cdiv(n, triton_lora._BLOCK_N) for n in sizes)
    (shrink, (shrink_tiles, slices, column_blocks)), expand = launches
    assert (shrink, shrink_tiles) == (triton_lora._shrink_kernel, token_tiles)
    assert slices > 1  # two tiles of a 136-wide reduction: each of its steps a slice
    assert column_blocks == triton.cdiv(len(sizes) * rank, 128)  # the dot's widest: rank 64 q/k/v's 192 in two
    assert expand == (triton_lora._expand_kernel, (token_tiles, column_tiles))


@pytest.mark.parametrize("programs", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_slices_of_several_steps_and_a_ragged_last_match_the_torch_path(programs, dtype, monkeypatch):
    """Rank 64's shrink steps 32 columns at a time in fp32, 64 in halves: aiming at 2 or 3 programs cuts K = 136
    into slices of one to three steps, the last partly past K, and the expand's sum of them is the whole product."""
    monkeypatch.setattr(triton_lora, "_PROGRAMS", programs)
    slots = SLOTS["adapters changing mid-tile"][:16]
    lora_a, lora_bs = make_layer(*LAYERS["rank 64, q/k/v-like"], dtype)
    y0, y, x = run_layer(slots, lora_a, lora_bs)
    expected = y0.float()
    batch = LoraBatch([])
    batch.set(np.array(slots))
    sizes = [b.shape[2] for b in lora_bs]
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    add_lora(expected, x.float(), lora_a.float(), [b.float() for b in lora_bs], offsets, batch)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "token_tiles, k, block_k, expected",
    [
        (1, 4096, 128, (32, 128)),  # a decode's q/k/v on an 8B model: every step a program
        (1, 14336, 128, (112, 128)),  # its down projection: 112 steps, more than _PROGRAMS wants, one each
        (4, 4096, 128, (32, 128)),
        (16, 4096, 128, (8, 512)),  # 16 tiles of 8 slices: 128 programs
        (128, 4096, 128, (1, 4096)),  # enough tiles: the reduction whole
        (2, 136, 16, (9, 16)),
    ],
)
def test_the_shrink_spreads_a_small_step_over_about_an_sm_count_of_programs(token_tiles, k, block_k, expected):
    """(slices, slice length): whole steps, none empty, about _PROGRAMS programs with the token tiles."""
    assert triton_lora._slicing(token_tiles, k, block_k) == expected


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
