"""FP8 MoE experts: fp8_products on a tiny Qwen3-MoE FP8 checkpoint, run on CPU (where kernels.moe.fused_moe takes
the torch path of the Triton kernel's FP8 numerics, tests/kernels/test_triton_moe.py): the experts hold the
checkpoint's float8 values and scales, whole or a tensor-parallel rank's units of them, and move the logits about
as far as the weights' quantization did; a layout whose tiles this rank's units cut stays dequantized, logged with
why."""

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from kernels import select_backend
from kernels.fp8 import fp8_values
from tests.workers.fp8 import SCHEMES, Scheme, write_fp8_checkpoint
from tests.workers.test_models import QWEN3_MOE, _free_port, random_seqs, run_paged
from tests.workers.test_quantization import mean_deviation
from workers.model_loader import load_model, read_model_spec
from workers.model_spec import ModelSpec
from workers.models.moe import SparseMoeBlock
from workers.quantization.conversion import fp8_products
from workers.weight_update import update_weights

MOE_BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]
UNITS = QWEN3_MOE["moe_intermediate_size"]  # 32 per expert; hidden size 64


def blocks(rows: int, cols: int) -> Scheme:
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [rows, cols]}
    return Scheme(config, (rows, cols), "weight_scale_inv")


LAYOUTS = {
    "rows": SCHEMES["compressed-tensors per channel"],
    "one scale a tensor": Scheme({"quant_method": "fp8", "activation_scheme": "dynamic"}, None),
    "32x32 blocks": SCHEMES["fp8 blocks 32x32"],
    "16x32 blocks": blocks(16, 32),
    "48x48 blocks (ragged)": SCHEMES["compressed-tensors blocks 48x48 (ragged)"],
}


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory):
    """`checkpoint(layout, units)` -> (float dir, FP8 dir, the FP8 dir's tensors as stored), made once: the tiny
    Qwen3-MoE with `units` per expert (default UNITS)."""
    made = {}

    def make(layout: str, units: int = UNITS):
        if (layout, units) not in made:
            src = tiny_model_dir("qwen3_moe", None, **{**QWEN3_MOE, "moe_intermediate_size": units})
            dst = tmp_path_factory.mktemp("moe-fp8")
            write_fp8_checkpoint(src, dst, LAYOUTS[layout])
            made[layout, units] = src, dst, load_file(dst / "model.safetensors")
        return made[layout, units]

    return make


def converted_model(path, **kw) -> tuple[torch.nn.Module, list[str]]:
    """The model at `path` (CPU, torch attention) converted by fp8_products, and what it converted."""
    spec = read_model_spec(path, kw.get("tp_size", 1))
    model = load_model(path, attn_backend=select_backend("torch", torch.device("cpu")), **kw)
    return model, fp8_products(model, spec.quantization)


def checkpoint_experts(
    stored: dict[str, torch.Tensor], layout: str, block: str, experts: range, units: slice
) -> tuple[torch.Tensor, ...]:
    """(w13, w13 scales, w2, w2 scales) as the checkpoint stores MoE block `block`'s `experts`, cut to `units` of
    each: the float8 values stacked as SparseMoeBlock stacks them, and their scales (per row, or the tiles')."""
    scheme = LAYOUTS[layout]
    tile = None if scheme.tile in ((1, 0), None) else scheme.tile
    unit_rows = units if tile is None else slice(units.start // tile[0], -(-units.stop // tile[0]))
    unit_cols = slice(None) if tile is None else slice(units.start // tile[1], -(-units.stop // tile[1]))
    w13, w13_scale, w2, w2_scale = [], [], [], []
    for e in experts:
        gate, up, down = (f"{block}.experts.{e}.{m}" for m in ("gate_proj", "up_proj", "down_proj"))
        scale = {m: stored[f"{m}.{scheme.scale_name}"] for m in (gate, up, down)}
        if scheme.tile is None:  # one scale a tensor: each row at it
            scale = {m: s.expand(stored[f"{m}.weight"].shape[0], 1) for m, s in scale.items()}
        w13.append(torch.cat([stored[f"{gate}.weight"][units], stored[f"{up}.weight"][units]]))
        w13_scale.append(torch.cat([scale[gate][unit_rows], scale[up][unit_rows]]))
        w2.append(stored[f"{down}.weight"][:, units])
        w2_scale.append(scale[down][:, unit_cols])
    flat = (lambda s: s.view(s.shape[0], -1)) if tile is None else (lambda s: s)  # per channel: [out, 1] each
    return torch.stack(w13), flat(torch.stack(w13_scale)), torch.stack(w2), flat(torch.stack(w2_scale))


def held(moe: SparseMoeBlock) -> tuple[torch.Tensor, ...]:
    return moe.w13, moe.w13_scale, moe.w2, moe.w2_scale


def assert_holds(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    """The experts' (w13, w13 scales, w2, w2 scales): their float8 values are the checkpoint's, their scales within
    the model dtype's rounding of 448 x scale (the dequantized weights' largest magnitudes, which the
    requantization divides by 448)."""
    for weight, want in zip(got[::2], expected[::2]):
        assert weight.dtype == torch.float8_e4m3fn and torch.equal(weight.float(), want.float())
    for scale, want in zip(got[1::2], expected[1::2]):
        assert scale.dtype == torch.float32
        torch.testing.assert_close(scale, want, rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["rows", "one scale a tensor", "32x32 blocks"])
def test_fp8_experts_hold_the_checkpoints_float8_values(checkpoint, layout, dtype):
    """Per row or per tile, requantized from the dequantized weights at the checkpoint's own scales where each row
    has one (a per-tensor checkpoint's repeated over its rows: the rows' own maxima would round its values again),
    from the tiles' maxima for blocks."""
    _, path, stored = checkpoint(layout)
    model, converted = converted_model(path, dtype=dtype)
    assert set(MOE_BLOCKS) <= set(converted)
    for name in MOE_BLOCKS:
        moe = model.get_submodule(name)
        assert moe.weight_block == ((32, 32) if layout == "32x32 blocks" else None)
        assert_holds(held(moe), checkpoint_experts(stored, layout, name, range(8), slice(0, UNITS)), dtype)


def test_tensor_and_expert_parallel_ranks_hold_their_share_of_the_checkpoints_tiles(checkpoint):
    """32x32 tiles of experts of 64 units: a tensor-parallel rank's 32 units of each expert start and end on tiles
    (tiles need at least 32 columns: a GPU's 8-bit dot takes K >= 32). Expert parallel: whole experts, 4 of the 8
    per rank. Rank 1 of 2 either way (tiles need no collective to requantize)."""
    _, path, stored = checkpoint("32x32 blocks", 64)
    model, converted = converted_model(path, tp_rank=1, tp_size=2)
    assert set(MOE_BLOCKS) <= set(converted)
    assert_holds(
        held(model.get_submodule(MOE_BLOCKS[1])),
        checkpoint_experts(stored, "32x32 blocks", MOE_BLOCKS[1], range(8), slice(32, 64)),
        torch.float32,
    )
    model, converted = converted_model(path, tp_rank=1, tp_size=2, expert_parallel=True)
    assert set(MOE_BLOCKS) <= set(converted)
    assert_holds(
        held(model.get_submodule(MOE_BLOCKS[1])),
        checkpoint_experts(stored, "32x32 blocks", MOE_BLOCKS[1], range(4, 8), slice(0, 64)),
        torch.float32,
    )


def _fp8_experts_rank(rank: int, port: int, path: str, spec: ModelSpec, out_dir: str) -> None:
    """Tensor-parallel rank `rank` of 2 (gloo): its shard converted by fp8_products, its experts saved."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = load_model(path, tp_rank=rank, tp_size=2, spec=spec)
        fp8_products(model, spec.quantization)
        # detached: the parameters carry their weight loaders (bound methods), which weights-only loading refuses
        saved = {n: tuple(t.detach() for t in held(model.get_submodule(n))) for n in MOE_BLOCKS}
        torch.save(saved, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_models' ranks leave: torch's C++ teardown aborts now and then


def test_tensor_parallel_ranks_hold_the_whole_rows_scales_of_down(checkpoint, tmp_path):
    """Per channel, each rank holds 16 of each expert's 32 units: its gate and up rows with their own scales, and
    down's columns with the scales of down's whole rows (reduced over the ranks), so that the checkpoint's FP8
    values come back; a scale of this half's own would be smaller wherever the row's largest magnitude is in the
    other half."""
    _, path, stored = checkpoint("rows")
    spec = read_model_spec(path, 2)
    mp.spawn(_fp8_experts_rank, args=(_free_port(), str(path), spec, str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        for name, got in torch.load(tmp_path / f"{r}.pt").items():
            assert_holds(
                got, checkpoint_experts(stored, "rows", name, range(8), slice(16 * r, 16 * r + 16)), torch.float32
            )
            assert bool((got[2].float().abs().amax(dim=2) < 448).any()), name  # rows whose largest is elsewhere


@pytest.mark.parametrize("layout", ["rows", "32x32 blocks"])
def test_fp8_experts_move_the_logits_as_little_as_the_weights_quantization_did(checkpoint, layout):
    """As test_quantization.py's test of linear layers, with only the experts converted (the attention's layers
    left dequantized by a quantization that ignores them), so that the deviation is the experts' own: their
    activations quantized per token (per 32 columns with tiles) move the logits from the dequantized model's about
    as far as the weights' quantization moved those from the plain model's. Measured 1.2x (rows), 0.4x (32x32
    tiles: the activations' groups of 32 columns each get a scale of their own); bound 2x."""
    src, path, _ = checkpoint(layout)
    backend = select_backend("torch", torch.device("cpu"))
    seqs = random_seqs(read_model_spec(path).vocab_size)
    plain = run_paged(load_model(src, attn_backend=backend), seqs)
    dequantized = run_paged(load_model(path, attn_backend=backend), seqs)
    model = load_model(path, attn_backend=backend)
    quantization = read_model_spec(path).quantization
    experts_only = dataclasses.replace(quantization, ignore=(*quantization.ignore, r"\.self_attn\."))
    assert fp8_products(model, experts_only) == MOE_BLOCKS
    got = run_paged(model, seqs)
    deviation, by_weights = mean_deviation(got, dequantized), mean_deviation(dequantized, plain)
    print(f"\n{layout}: FP8 experts vs dequantized {deviation:.3f} (dequantized vs plain {by_weights:.3f})")
    assert 1e-3 < deviation <= 2 * by_weights


@pytest.mark.parametrize(
    "layout, tp_size, why",
    [
        ("32x32 blocks", 2, "this rank's units 0..16 of each expert's 32 (rows of gate, then of up) cut the 32x32"),
        ("16x32 blocks", 2, "this rank's units 0..16 of each expert's 32 (columns of down) cut the 16x32 blocks"),
        # Whole experts too: gate's 32 rows end inside a 48-row tile that up's first rows would share in w13.
        ("48x48 blocks (ragged)", 1, "this rank's units 0..32 of each expert's 32 (rows of gate, then of up) cut"),
    ],
)
def test_experts_whose_tiles_this_ranks_units_cut_stay_dequantized(checkpoint, caplog, layout, tp_size, why):
    _, path, _ = checkpoint(layout)
    with caplog.at_level(logging.WARNING, logger="workers.quantization"):
        model, converted = converted_model(path, tp_rank=0, tp_size=tp_size)
    assert not set(MOE_BLOCKS) & set(converted)
    for name in MOE_BLOCKS:
        moe = model.get_submodule(name)
        assert moe.w13.dtype == moe.w2.dtype == torch.float32 and moe.w13_scale is None
    [line] = [m for m in caplog.messages if "MoE blocks" in m]
    assert f"2 MoE blocks ({MOE_BLOCKS[0]}, ...) keep their weights dequantized in torch.float32: {why}" in line


@pytest.mark.parametrize("layout", ["rows", "32x32 blocks"])
def test_a_weight_update_requantizes_the_fp8_layers_and_experts_it_writes(checkpoint, layout):
    """A trainer's float tensors pushed into FP8 products (workers/weight_update.py): the attention's fused qkv and an
    expert's gate and down come back as the pushed values, to FP8's rounding, at scales of their own; the parts no
    tensor named (k and v, up, the other experts) are as they were."""
    src, path, _ = checkpoint(layout, 64)
    model, converted = converted_model(path)
    qkv, moe = model.get_submodule("model.layers.0.self_attn.qkv_proj"), model.get_submodule(MOE_BLOCKS[0])
    assert {"model.layers.0.self_attn.qkv_proj", MOE_BLOCKS[0]} <= set(converted)

    def dequantized() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            fp8_values(qkv.weight, qkv.weight_scale, qkv.weight_block),
            fp8_values(moe.w13, moe.w13_scale, moe.weight_block),
            fp8_values(moe.w2, moe.w2_scale, moe.weight_block),
        )

    before = dequantized()
    dense = load_file(Path(src) / "model.safetensors")
    expert = f"{MOE_BLOCKS[0]}.experts.0"
    pushed = {
        name: 1.5 * dense[name]
        for name in (
            "model.layers.0.self_attn.q_proj.weight",
            f"{expert}.gate_proj.weight",
            f"{expert}.down_proj.weight",
        )
    }
    update_weights(model, pushed.items(), torch.float32, pack=False)
    assert qkv.weight.dtype == moe.w13.dtype == torch.float8_e4m3fn
    weight, w13, w2 = dequantized()
    q_rows, units = pushed["model.layers.0.self_attn.q_proj.weight"].shape[0], w13.shape[1] // 2
    for got, want in [
        (weight[:q_rows], pushed["model.layers.0.self_attn.q_proj.weight"]),
        (w13[0, :units], pushed[f"{expert}.gate_proj.weight"]),
        (w2[0], pushed[f"{expert}.down_proj.weight"]),
    ]:
        # e4m3 keeps 3 bits of mantissa: within 1/16 of each value, and the subnormals' step near zero
        torch.testing.assert_close(got, want, rtol=2**-4, atol=float(want.abs().max()) / 448 * 2**-9)
    torch.testing.assert_close(weight[q_rows:], before[0][q_rows:], rtol=2**-4, atol=1e-6)
    torch.testing.assert_close(w13[0, units:], before[1][0, units:], rtol=2**-4, atol=1e-6)
    torch.testing.assert_close(w13[1:], before[1][1:], rtol=2**-4, atol=1e-6)
    torch.testing.assert_close(w2[1:], before[2][1:], rtol=2**-4, atol=1e-6)
