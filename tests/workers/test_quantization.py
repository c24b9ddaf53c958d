"""FP8 checkpoints made by the tests (tests/workers/fp8.py) through the real loader: their logits against a float64
model of the weights they stand for, tensor-parallel ranks' slices against the whole, and the checkpoints and
methods that are refused. Then FP8 products (fp8_products, run on CPU): the checkpoints' FP8 weights held, logits
near the dequantized model's, what stays dequantized and why, LoRA on an FP8 layer, and tensor-parallel ranks'
FP8 rows."""

import itertools
import json
import logging
import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from kernels import select_backend
from kernels.lora import LoraBatch
from tests.workers.fp8 import FP8_MAX, SCHEMES, STATIC_ACTIVATIONS, _ct, write_fp8_checkpoint
from tests.workers.test_models import QWEN3_MOE, _free_port, random_seqs, run_paged
from workers.layers import ColumnParallelLinear, RowParallelLinear, Shard
from workers.lora import LinearLora
from workers.model_loader import load_model, read_model_spec
from workers.model_spec import ModelSpec
from workers.quantization.config import Fp8Scheme, WeightQuantization
from workers.quantization.conversion import _agreed, checkpoint_modules, fp8_products, fp8_products_where_supported

MODELS = {"llama": ("llama", {}), "qwen3_moe": ("qwen3_moe", QWEN3_MOE)}
# Every scheme on the dense model; the experts (stacked per layer from per-expert tensors) in ragged tiles.
CASES = [*(("llama", s) for s in SCHEMES), ("qwen3_moe", "compressed-tensors blocks 48x48 (ragged)")]


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model_dir, tmp_path_factory):
    """`fp8_checkpoint(model, scheme)` -> (float dir, FP8 dir, the float64 weights it stands for), made once."""
    made = {}

    def make(model: str, scheme: str):
        if (model, scheme) not in made:
            model_type, overrides = MODELS[model]
            src = tiny_model_dir(model_type, None, **overrides)
            dst = tmp_path_factory.mktemp("fp8")
            made[model, scheme] = src, dst, write_fp8_checkpoint(src, dst, SCHEMES[scheme])
        return made[model, scheme]

    return make


def float64_logits(
    src: str,
    weights: dict[str, torch.Tensor],
    seqs: list[list[int]],
    tmp: Path,
    input_scales: dict[str, torch.Tensor] | None = None,
    expert_scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """transformers' model of `src` in float64 holding `weights` (written as a checkpoint, for transformers to map
    per-expert tensors onto its fused experts as it does a published one's), the input of each linear layer that
    `input_scales` names rounded through FP8 at its scale (x / scale, clamped to +-448, float8_e4m3fn, times
    scale), as a static checkpoint's activations are; the experts modules `expert_scales` names likewise, each
    product's input at its one scale (the first's, the second's) whichever expert it goes to."""
    from transformers import AutoModelForCausalLM

    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text((Path(src) / "config.json").read_text())
    save_file(weights, tmp / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float64, experts_implementation="eager")
    for name, scale in (input_scales or {}).items():
        model.get_submodule(name).register_forward_pre_hook(partial(round_input, scale.double()))
    for name, scales in (expert_scales or {}).items():
        experts = model.get_submodule(name)
        experts.forward = partial(static_experts, experts, *(s.double() for s in scales))
    with torch.inference_mode():
        return [model(torch.tensor([s])).logits[0] for s in seqs]


def round_input(scale: torch.Tensor, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple:
    x = args[0]
    return ((x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale, *args[1:])


def static_experts(experts, s13: torch.Tensor, s2: torch.Tensor, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """transformers' experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) token by token, each product's input
    rounded through FP8 at its static scale."""
    out = torch.zeros_like(hidden)
    x = round_input(s13, None, (hidden,))[0]
    for t in range(x.shape[0]):
        for w, e in zip(top_k_weights[t], top_k_index[t]):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            h = round_input(s2, None, (torch.nn.functional.silu(gate) * up,))[0]
            out[t] += w * (experts.down_proj[e] @ h)
    return out


def input_scales(path: Path) -> dict[str, torch.Tensor]:
    """Layer -> its static input scale, of the checkpoint at `path`."""
    stored = load_file(path / "model.safetensors")
    return {n.removesuffix(".input_scale"): t.reshape(()) for n, t in stored.items() if n.endswith(".input_scale")}


@pytest.mark.parametrize("model, scheme", CASES)
def test_fp8_checkpoint_matches_float64_reference(fp8_checkpoint, model, scheme, tmp_path):
    src, dst, weights = fp8_checkpoint(model, scheme)
    spec = read_model_spec(dst)
    assert spec.quantization is not None and spec.quantization.scheme("lm_head") is None
    seqs = random_seqs(spec.vocab_size)
    ours = run_paged(load_model(dst, attn_backend=select_backend("torch", torch.device("cpu"))), seqs)
    # A static checkpoint's activations are rounded through FP8 at their scales, its weights held dequantized.
    scales = input_scales(dst)
    assert bool(scales) == SCHEMES[scheme].static
    for o, r in zip(ours, float64_logits(src, weights, seqs, tmp_path / "rounded", scales)):
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)
    # The quantization is coarse enough to tell: the FP8 model is not the float one, nor a static one the model
    # of its weights alone.
    plain = run_paged(load_model(src, attn_backend=select_backend("torch", torch.device("cpu"))), seqs)
    assert max((o - p).abs().max().item() for o, p in zip(ours, plain)) > 1e-3
    if scales:
        weights_only = float64_logits(src, weights, seqs, tmp_path / "weights")
        assert max((o.double() - w).abs().max().item() for o, w in zip(ours, weights_only)) > 1e-3


def test_fp8_weights_dequantize_in_the_compute_dtype(fp8_checkpoint):
    _, dst, weights = fp8_checkpoint("llama", "fp8 blocks 32x32")
    model = load_model(dst, dtype=torch.bfloat16)
    w = model.state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.bfloat16
    torch.testing.assert_close(w, weights["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("model", MODELS)
def test_tensor_parallel_slices_cut_tiles_exactly(fp8_checkpoint, model):
    # 48x48 tiles: a rank's half of 64 k_proj rows (1 KV head of 16 dims each), of 128 MLP units or of an expert's
    # 32 units starts or ends inside a tile, whose scale it must still take.
    _, dst, _ = fp8_checkpoint(model, "compressed-tensors blocks 48x48 (ragged)")
    full = load_model(dst).state_dict()
    ranks = [load_model(dst, tp_rank=r, tp_size=2).state_dict() for r in (0, 1)]
    qkv, o = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    q, k, v = full[qkv].split([64, 32, 32])
    for r, sd in enumerate(ranks):
        rows = slice(16 * r, 16 * r + 16)
        assert torch.equal(sd[qkv], torch.cat([q[32 * r : 32 * r + 32], k[rows], v[rows]]))
        assert torch.equal(sd[o], full[o][:, 32 * r : 32 * r + 32])
    if model == "llama":
        gate_up, down = "model.layers.1.mlp.gate_up_proj.weight", "model.layers.1.mlp.down_proj.weight"
        gate, up = full[gate_up].chunk(2)
        for r, sd in enumerate(ranks):
            units = slice(64 * r, 64 * r + 64)
            assert torch.equal(sd[gate_up], torch.cat([gate[units], up[units]]))
            assert torch.equal(sd[down], full[down][:, units])
    else:
        w13, w2 = "model.layers.1.mlp.w13", "model.layers.1.mlp.w2"
        gate, up = full[w13].chunk(2, dim=1)
        for r, sd in enumerate(ranks):
            units = slice(16 * r, 16 * r + 16)
            assert torch.equal(sd[w13], torch.cat([gate[:, units], up[:, units]], dim=1))
            assert torch.equal(sd[w2], full[w2][:, :, units])
        for r in (0, 1):  # expert parallel: whole experts, each read through its own scales
            ep = load_model(dst, tp_rank=r, tp_size=2, expert_parallel=True).state_dict()
            assert torch.equal(ep[w13], full[w13][4 * r : 4 * r + 4]) and torch.equal(
                ep[w2], full[w2][4 * r : 4 * r + 4]
            )


def _with_config(src: str, dst: Path, quantization_config: dict | None, edit=None) -> Path:
    dst.mkdir(exist_ok=True)
    config = json.loads((Path(src) / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(Path(src) / "model.safetensors")
    if edit is not None:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
INT8_W8A8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}
    },
}
NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}
    },
}


@pytest.mark.parametrize(
    "config, named",
    [
        (GPTQ, "'gptq'"),
        (AWQ, "'awq'"),
        (BNB, "'bitsandbytes'"),
        ({"quant_method": "mxfp4"}, "'mxfp4'"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'modelopt'"),
        ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "'fbgemm_fp8'"),
        (INT8_W8A8, r"'compressed-tensors' with int 8-bit weights"),
        (NVFP4, r"'compressed-tensors' with float 4-bit weights"),
        (
            {**SCHEMES["compressed-tensors per channel"].config, "format": "pack-quantized"},
            "'compressed-tensors' with format 'pack-quantized'",
        ),
    ],
)
def test_unsupported_methods_are_refused_by_name(tiny_model_dir, tmp_path, config, named):
    path = _with_config(tiny_model_dir("qwen3_moe", None, **QWEN3_MOE), tmp_path, config)
    with pytest.raises(ValueError, match=rf"quantization method {named}.*supported: \['fp8', 'compressed-tensors"):
        read_model_spec(path)


def test_a_quantize_config_file_is_refused(tiny_model_dir, tmp_path):
    path = _with_config(tiny_model_dir("llama"), tmp_path, None)
    (path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(ValueError, match=r"quantization method 'gptq' \(quantize_config.json\) is not supported"):
        read_model_spec(path)


def test_missing_or_misshaped_scale_is_named(fp8_checkpoint, tmp_path):
    src, dst, _ = fp8_checkpoint("llama", "fp8 blocks 32x32")
    scale = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    missing = _with_config(str(dst), tmp_path / "missing", config, lambda t: t.pop(scale))
    with pytest.raises(ValueError, match=rf"scale tensor {scale} is missing.*k_proj.weight is float8"):
        load_model(missing)

    def transpose(tensors):
        tensors[scale] = tensors[scale].T.contiguous()  # k_proj is [32, 64]: its tiles are [1, 2], not [2, 1]

    misshaped = _with_config(str(dst), tmp_path / "misshaped", config, transpose)
    with pytest.raises(ValueError, match=rf"scale tensor {scale} has shape \[2, 1\].*expected \[1, 2\]"):
        load_model(misshaped)


STATIC = "compressed-tensors per channel (static activations)"


def test_static_input_scales_are_whole_on_every_rank_and_the_largest_of_a_fused_layers(fp8_checkpoint, tmp_path):
    """An input scale is one per tensor: each tensor-parallel rank holds it whole. q/k/v (gate/up) share one input,
    quantized once: with the largest of their scales."""
    _, dst, _ = fp8_checkpoint("llama", STATIC)
    k, up = "model.layers.0.self_attn.k_proj.input_scale", "model.layers.1.mlp.up_proj.input_scale"

    def raise_two(tensors):
        tensors[k], tensors[up] = tensors[k] * 4, tensors[up] * 2

    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    path = _with_config(str(dst), tmp_path, config, raise_two)
    stored = input_scales(path)
    assert read_model_spec(path).quantization.scheme("model.layers.0.self_attn.q_proj").static
    want = {
        "model.layers.0.self_attn.qkv_proj": stored[k.removesuffix(".input_scale")],
        "model.layers.1.mlp.gate_up_proj": stored[up.removesuffix(".input_scale")],
        **{n: stored[n] for n in LINEARS if n.endswith(("o_proj", "down_proj"))},
    }
    for model in [load_model(path), *(load_model(path, tp_rank=r, tp_size=2) for r in (0, 1))]:
        for name, scale in want.items():
            got = model.get_submodule(name).input_scale
            assert got.dtype == torch.float32 and got.shape == () and torch.equal(got, scale), name


def test_a_static_input_scale_missing_or_misshaped_is_named(fp8_checkpoint, tmp_path):
    _, dst, _ = fp8_checkpoint("llama", "fp8 per tensor (static activations)")
    scale = "model.layers.1.self_attn.o_proj.input_scale"
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    missing = _with_config(str(dst), tmp_path / "missing", config, lambda t: t.pop(scale))
    with pytest.raises(ValueError, match=rf"scale tensor {scale} is missing.*o_proj quantizes its activations stat"):
        load_model(missing)

    def per_channel(tensors):
        tensors[scale] = tensors[scale].repeat(64)

    misshaped = _with_config(str(dst), tmp_path / "misshaped", config, per_channel)
    with pytest.raises(ValueError, match=rf"scale tensor {scale} has shape \[64\] .*expected one element"):
        load_model(misshaped)
    zero = _with_config(str(dst), tmp_path / "zero", config, lambda t: t.update({scale: torch.tensor(0.0)}))
    with pytest.raises(ValueError, match=rf"scale tensor {scale} is 0.0 .*expected a positive number"):
        load_model(zero)


@pytest.mark.parametrize(
    "activations, named",
    [
        ({**STATIC_ACTIVATIONS, "type": "int", "dynamic": True, "strategy": "token"}, "int 8-bit, dynamic=True"),
        ({**STATIC_ACTIVATIONS, "type": "int"}, "int 8-bit, dynamic=False"),
        ({**STATIC_ACTIVATIONS, "num_bits": 4, "dynamic": "local"}, "float 4-bit, dynamic='local'"),
        ({**STATIC_ACTIVATIONS, "strategy": "token"}, "float 8-bit, dynamic=False, strategy='token'"),
        ({**STATIC_ACTIVATIONS, "symmetric": False}, "float 8-bit, .*symmetric=False"),
    ],
)
def test_unsupported_input_activations_are_refused_by_name(tiny_model_dir, tmp_path, activations, named):
    # int8 activations beside FP8 weights would otherwise run as W8A8-fp8.
    path = _with_config(tiny_model_dir("llama"), tmp_path, _ct("channel", None, activations))
    supported = r"supported: \['float 8-bit dynamic', 'float 8-bit static per tensor"
    with pytest.raises(ValueError, match=rf"compressed-tensors input_activations \({named}.*{supported}"):
        read_model_spec(path)


def test_static_activations_with_block_weights_are_refused(tiny_model_dir, tmp_path):
    fp8 = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32]}
    with pytest.raises(ValueError, match=r"activation_scheme 'static' with weight_block_size is not supported"):
        read_model_spec(_with_config(tiny_model_dir("llama"), tmp_path / "fp8", fp8))
    ct = _ct("block", [32, 32], STATIC_ACTIVATIONS)
    with pytest.raises(ValueError, match=r"dynamic=False, strategy='tensor'.*block weights\) are not supported"):
        read_model_spec(_with_config(tiny_model_dir("llama"), tmp_path / "ct", ct))


def with_static_moe(dst: Path, tmp: Path, weights: dict[str, torch.Tensor], edit=None) -> Path:
    """The per-channel MoE checkpoint at `dst` made static: each attention projection's input scale 0.02 and each
    expert's its own, growing with the expert's index (gate and up 0.01 to 0.0275, down 0.005 to 0.01375), the
    routers left plain; then `edit`."""

    def add_input_scales(tensors):
        for layer in [n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")]:
            if layer.endswith("mlp.gate"):  # a router's product is a plain one
                tensors.pop(f"{layer}.weight_scale")
                tensors[f"{layer}.weight"] = weights[f"{layer}.weight"].float()
                continue
            scale = 0.02
            if ".experts." in layer:
                expert = int(layer.split(".experts.")[1].split(".")[0])
                scale = (0.005 if layer.endswith("down_proj") else 0.01) * (1 + expert / 4)
            tensors[f"{layer}.input_scale"] = torch.tensor([scale])
        if edit is not None:
            edit(tensors)

    config = {**SCHEMES[STATIC].config, "ignore": ["lm_head", r"re:.*mlp\.gate$"]}
    return _with_config(str(dst), tmp, config, add_input_scales)


def test_static_experts_quantize_with_the_largest_of_their_experts_scales(fp8_checkpoint, tmp_path):
    """One scale per product for all of a block's experts, the largest of theirs (gate's and up's for the first,
    down's for the second), as vLLM takes it: the logits of a float64 model whose experts round their inputs at
    those scales; each tensor-parallel rank, holding a slice of every expert, takes the same."""
    src, dst, weights = fp8_checkpoint("qwen3_moe", "compressed-tensors per channel")
    path = with_static_moe(dst, tmp_path / "static", weights)
    model = load_model(path, attn_backend=select_backend("torch", torch.device("cpu")))
    for rank in [model, *(load_model(path, tp_rank=r, tp_size=2) for r in (0, 1))]:
        block = rank.get_submodule("model.layers.1.mlp")
        assert (float(block.w13_input_scale), float(block.w2_input_scale)) == pytest.approx((0.0275, 0.01375))
    scales = input_scales(path)
    attention = {n: scales[n] for n in scales if ".self_attn." in n}
    experts = {f"model.layers.{i}.mlp.experts": (torch.tensor(0.0275), torch.tensor(0.01375)) for i in (0, 1)}
    seqs = random_seqs(read_model_spec(path).vocab_size)
    expected = float64_logits(src, weights, seqs, tmp_path / "rounded", attention, experts)
    for o, r in zip(run_paged(model, seqs), expected):
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)
    assert model.get_submodule("model.layers.0.self_attn.qkv_proj").input_scale is not None


def test_static_moe_routers_experts_static_in_part_and_expert_parallel_are_refused(fp8_checkpoint, tmp_path):
    """A router's product is a plain one; a block's experts share one scale a product, so all or none of them are
    static; under expert parallel a rank holds only its experts' scales, not the largest of all."""
    _, dst, weights = fp8_checkpoint("qwen3_moe", "compressed-tensors per channel")
    config = SCHEMES[STATIC].config

    def add_input_scales(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name.replace(".weight_scale", ".input_scale")] = torch.tensor([0.02])

    with pytest.raises(ValueError, match=r"weight model.layers.0.mlp.gate.weight has a static .* \(a MoE router\)"):
        load_model(_with_config(str(dst), tmp_path / "router", config, add_input_scales))

    def plain_expert_3(tensors):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layer = f"model.layers.0.mlp.experts.3.{proj}"
            tensors.pop(f"{layer}.weight_scale"), tensors.pop(f"{layer}.input_scale")
            tensors[f"{layer}.weight"] = weights[f"{layer}.weight"].float()

    in_part = with_static_moe(dst, tmp_path / "in part", weights, plain_expert_3)
    with open(in_part / "config.json") as f:
        ct = json.load(f)
    ct["quantization_config"]["ignore"].append(r"re:.*experts\.3\..*")
    (in_part / "config.json").write_text(json.dumps(ct))
    with pytest.raises(ValueError, match=r"experts\.3\..*some experts of this MoE block have a static"):
        load_model(in_part)
    static = with_static_moe(dst, tmp_path / "static", weights)
    with pytest.raises(ValueError, match=r"experts\.4\.gate_proj.weight has a static .* --enable-expert-parallel"):
        load_model(static, tp_rank=1, tp_size=2, expert_parallel=True)


def test_a_fused_layer_static_in_part_is_refused(fp8_checkpoint, tmp_path):
    # k_proj left plain by the config: qkv_proj's one input cannot be quantized for q and v and not for k.
    _, dst, weights = fp8_checkpoint("llama", STATIC)
    config = {**SCHEMES[STATIC].config, "ignore": ["lm_head", r"re:.*k_proj$"]}

    def plain_k_proj(tensors):
        for layer in [n.removesuffix(".weight") for n in tensors if n.endswith("k_proj.weight")]:
            tensors.pop(f"{layer}.weight_scale"), tensors.pop(f"{layer}.input_scale")
            tensors[f"{layer}.weight"] = weights[f"{layer}.weight"].float()

    with pytest.raises(ValueError, match=r"self_attn: \['q_proj', 'v_proj'\] quantize .* but \['k_proj'\] do not"):
        load_model(_with_config(str(dst), tmp_path, config, plain_k_proj))


def test_float8_weights_without_their_config_are_refused(fp8_checkpoint, tmp_path):
    # The bug this closes: float8 weights read as if plain, without their scales.
    _, dst, _ = fp8_checkpoint("llama", "compressed-tensors per channel")
    with pytest.raises(ValueError, match=r"weight model.layers.0.*is stored as F8_E4M3, but config.json has no"):
        load_model(_with_config(str(dst), tmp_path / "no-config", None))
    # A layer the config leaves unquantized (ignored) but stored in float8 is refused just the same.
    config = {**SCHEMES["compressed-tensors per channel"].config, "ignore": ["lm_head", "re:.*mlp.down_proj$"]}
    with pytest.raises(
        ValueError, match=r"down_proj.weight is stored as F8_E4M3, but .* leaves model.layers.0.mlp.down"
    ):
        load_model(_with_config(str(dst), tmp_path / "ignored", config))


def test_ignored_layers_load_as_plain_ones(fp8_checkpoint, tmp_path):
    _, dst, weights = fp8_checkpoint("llama", "fp8 blocks 32x32")
    config = {**SCHEMES["fp8 blocks 32x32"].config, "modules_to_not_convert": ["model.layers.*.mlp.down_proj"]}

    def unquantize_down_proj(tensors):
        for name in [n for n in tensors if "down_proj" in n]:
            tensors.pop(name)
        tensors.update({n: w.float() for n, w in weights.items() if "down_proj" in n})

    path = _with_config(str(dst), tmp_path, config, unquantize_down_proj)
    quantization = read_model_spec(path).quantization
    assert quantization.scheme("model.layers.1.mlp.down_proj") is None
    assert quantization.scheme("model.layers.1.mlp.up_proj") is not None
    loaded = load_model(path).state_dict()
    down, up = "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(loaded[down], weights[down].float())
    torch.testing.assert_close(loaded["model.layers.1.mlp.gate_up_proj.weight"][128:], weights[up].float())
    ct = {**SCHEMES["compressed-tensors per channel"].config, "ignore": ["lm_head", "re:.*mlp.gate$"]}
    ct_quantization = read_model_spec(_with_config(str(dst), tmp_path / "ct", ct)).quantization
    assert ct_quantization.scheme("model.layers.0.mlp.gate") is None
    assert ct_quantization.scheme("model.layers.0.mlp.gate_proj").strategy == "channel"


def test_quantization_fp8_quantizes_a_plain_checkpoint_per_channel(fp8_checkpoint, tmp_path):
    # --quantization fp8 stores what a per-channel FP8 checkpoint made from the same weights stores.
    src, per_channel, weights = fp8_checkpoint("llama", "compressed-tensors per channel")
    spec = read_model_spec(src, quantization="fp8")
    assert spec.quantization.at_load and spec.quantization.scheme("lm_head") is None
    assert spec.quantization.scheme("model.layers.0.mlp.gate") is None  # a MoE router
    model = load_model(src, quantization="fp8", attn_backend=select_backend("torch", torch.device("cpu")))
    expected = load_model(per_channel).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    seqs = random_seqs(spec.vocab_size)
    for o, r in zip(run_paged(model, seqs), float64_logits(src, weights, seqs, tmp_path)):
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)


def test_quantization_fp8_slices_whole_rows_under_tensor_parallel(tiny_model_dir):
    src = tiny_model_dir("llama")
    full = load_model(src, quantization="fp8").state_dict()
    assert not torch.equal(
        full["model.layers.0.mlp.down_proj.weight"], load_model(src).state_dict()["model.layers.0.mlp.down_proj.weight"]
    )
    o, down = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"
    gate_up = "model.layers.1.mlp.gate_up_proj.weight"
    gate, up = full[gate_up].chunk(2)
    for r in (0, 1):
        sd = load_model(src, tp_rank=r, tp_size=2, quantization="fp8").state_dict()
        # Row-parallel halves hold the whole rows' quantization, not one of their own.
        assert torch.equal(sd[o], full[o][:, 32 * r : 32 * r + 32])
        assert torch.equal(sd[down], full[down][:, 64 * r : 64 * r + 64])
        assert torch.equal(sd[gate_up], torch.cat([gate[64 * r : 64 * r + 64], up[64 * r : 64 * r + 64]]))


def test_quantization_fp8_on_a_quantized_checkpoint(fp8_checkpoint, tiny_model_dir):
    _, fp8, _ = fp8_checkpoint("llama", "fp8 blocks 32x32")
    assert read_model_spec(fp8, quantization="fp8").quantization == read_model_spec(fp8).quantization
    _, ct, _ = fp8_checkpoint("llama", "compressed-tensors per channel")
    with pytest.raises(ValueError, match=r"--quantization fp8 .* quantization_config is compressed-tensors"):
        read_model_spec(ct, quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization method 'gptq' \(--quantization\) .* supported: \['fp8'\]"):
        read_model_spec(tiny_model_dir("llama"), quantization="gptq")


# FP8 products (W8A8): fp8_products on CPU, whose torch._scaled_mm takes row-wise scales as CUDA's does, and whose
# block products are kernels/fp8.py's torch path (the Triton kernel's sums, tests/kernels/test_triton_fp8.py).
PRODUCT_SCHEMES = [
    "fp8 per tensor (static activations)",
    "compressed-tensors per channel",
    STATIC,
    "quantization=fp8",
    "fp8 blocks 32x32",
]
# Activations quantized per token by the products and kept as they are by the dequantized model.
DYNAMIC_PRODUCT_SCHEMES = [s for s in PRODUCT_SCHEMES if "static" not in s]
LINEARS = [
    f"model.layers.{i}.{m}"
    for i in (0, 1)
    for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
]


def product_case(fp8_checkpoint, scheme: str) -> tuple[str, str, str | None]:
    """(the float checkpoint, the one `scheme` serves, its --quantization)."""
    src, _, _ = fp8_checkpoint("llama", "compressed-tensors per channel")
    if scheme == "quantization=fp8":
        return src, src, "fp8"
    return src, str(fp8_checkpoint("llama", scheme)[1]), None


def fp8_model(path: str, quantization: str | None = None, **kw) -> tuple[torch.nn.Module, list[str]]:
    """The model at `path` converted by fp8_products, and the layers it converted."""
    spec = read_model_spec(path, kw.get("tp_size", 1), quantization=quantization)
    model = load_model(path, attn_backend=select_backend("torch", torch.device("cpu")), quantization=quantization, **kw)
    return model, fp8_products(model, spec.quantization)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", PRODUCT_SCHEMES)
def test_fp8_products_hold_the_checkpoints_float8_weights(fp8_checkpoint, scheme, dtype):
    _, path, quantization = product_case(fp8_checkpoint, scheme)
    model, converted = fp8_model(path, quantization, dtype=dtype)
    assert converted == LINEARS
    dequantized_model = load_model(path, dtype, quantization=quantization)
    _, per_channel, _ = fp8_checkpoint("llama", "compressed-tensors per channel")
    stored = load_file(per_channel / "model.safetensors")
    for name in LINEARS:
        layer = model.get_submodule(name)
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
        # A static layer keeps the input scale it loaded with, the one the dequantized model rounds its input at.
        if "static" in scheme:
            assert torch.equal(layer.input_scale, dequantized_model.get_submodule(name).input_scale)
        else:
            assert layer.input_scale is None
        modules = checkpoint_modules(name, layer)
        if scheme == "fp8 blocks 32x32":
            # Requantized per 32x32 tile of the layer: the checkpoint's own tiles (a fused layer's parts start on
            # tile boundaries), so its FP8 values come back, and its scales within the dtype's rounding.
            blocks = load_file(Path(path) / "model.safetensors")
            assert layer.weight_block == (32, 32) and layer.weight_scale.shape == (
                layer.weight.shape[0] // 32,
                layer.weight.shape[1] // 32,
            )
            assert torch.equal(layer.weight.float(), torch.cat([blocks[f"{m}.weight"] for m in modules]).float())
            want = torch.cat([blocks[f"{m}.weight_scale_inv"] for m in modules])
            torch.testing.assert_close(layer.weight_scale, want, rtol=torch.finfo(dtype).eps, atol=0)
            continue
        assert layer.weight_block is None and layer.weight_scale.shape == (layer.weight.shape[0],)
        if scheme == "fp8 per tensor (static activations)":
            # Requantized per row at the scale of the tensor each row came from (q, k and v their own): the
            # checkpoint's FP8 values come back, not those of a finer grid per row.
            tensors = load_file(Path(path) / "model.safetensors")
            assert torch.equal(layer.weight.float(), torch.cat([tensors[f"{m}.weight"] for m in modules]).float())
            rows = [tensors[f"{m}.weight_scale"].expand(tensors[f"{m}.weight"].shape[0]) for m in modules]
            assert torch.equal(layer.weight_scale, torch.cat(rows))
            continue
        # Per channel, and --quantization fp8 (which stores what a per-channel checkpoint of the same weights
        # does): the stored FP8 values come back, their scales within the model dtype's rounding of 448 x scale.
        assert torch.equal(layer.weight.float(), torch.cat([stored[f"{m}.weight"] for m in modules]).float()), name
        want = torch.cat([stored[f"{m}.weight_scale"] for m in modules]).view(-1)
        torch.testing.assert_close(layer.weight_scale, want, rtol=torch.finfo(dtype).eps, atol=0)


def mean_deviation(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest over sequences of mean |logit difference| / mean |reference logit|."""
    return max(float((x - r).abs().mean() / r.abs().mean()) for x, r in zip(logits, reference))


def greedy_agreement(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The fraction of positions whose argmax (teacher-forced on the same tokens) is the reference's."""
    same = sum(int((x.argmax(-1) == r.argmax(-1)).sum()) for x, r in zip(logits, reference))
    return same / sum(len(r) for r in reference)


@pytest.mark.parametrize("scheme", DYNAMIC_PRODUCT_SCHEMES)
def test_fp8_products_move_the_logits_as_little_as_the_weights_quantization_did(fp8_checkpoint, scheme):
    """Activations quantized per token round the other operand of the same products onto the grid the weights were
    rounded to per row (3 mantissa bits: 2^-4 relative at most, ~2.5% of a product in this model): they move the
    logits about as far from the dequantized model's as the weights' quantization moved those from the plain
    model's (this 2-layer random model turns that into ~15% of its mean |logit|). Measured ~1.2x; bound 2x."""
    src, path, quantization = product_case(fp8_checkpoint, scheme)
    backend = select_backend("torch", torch.device("cpu"))
    seqs = random_seqs(read_model_spec(path).vocab_size)
    plain = run_paged(load_model(src, attn_backend=backend), seqs)
    dequantized = run_paged(load_model(path, attn_backend=backend, quantization=quantization), seqs)
    got = run_paged(fp8_model(path, quantization)[0], seqs)
    deviation, by_weights = mean_deviation(got, dequantized), mean_deviation(dequantized, plain)
    print(
        f"\n{scheme}: FP8 products vs dequantized: mean |logit error| {deviation:.3f} (dequantized vs plain "
        f"{by_weights:.3f}), greedy agreement {greedy_agreement(got, dequantized):.2f}"
    )
    assert 1e-3 < deviation <= 2 * by_weights


def test_static_fp8_products_are_the_float64_reference_with_rounded_activations(fp8_checkpoint, tmp_path):
    """Per channel, a static checkpoint's FP8 products multiply its own FP8 weights (requantized per row, they come
    back) by its activations quantized at their fixed scales: the float64 model of its weights with those
    activations rounded through FP8, to fp32's rounding. (Per-tensor weights land on a finer per-row grid:
    `test_fp8_products_hold_the_checkpoints_float8_weights`.)"""
    src, dst, weights = fp8_checkpoint("llama", STATIC)
    model, converted = fp8_model(str(dst))
    assert converted == LINEARS
    seqs = random_seqs(read_model_spec(dst).vocab_size)
    for o, r in zip(run_paged(model, seqs), float64_logits(src, weights, seqs, tmp_path, input_scales(dst))):
        torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)


def test_layers_whose_tiles_the_layout_cuts_or_the_kernel_cannot_step_stay_dequantized(fp8_checkpoint, caplog):
    """48x48 tiles: q_proj's 64 rows end in a 16-row tile, so qkv_proj's k_proj part starts inside one, as up_proj
    does in gate_up_proj (gate's 128 rows: 48 + 48 + 32); o_proj and down_proj lay out whole, but 48 columns are
    stepped through 16 at a time, and a GPU's 8-bit dot takes at least 32."""
    _, blocks, _ = fp8_checkpoint("llama", "compressed-tensors blocks 48x48 (ragged)")
    with caplog.at_level(logging.WARNING, logger="workers.quantization"):
        model, converted = fp8_model(blocks)
    assert converted == []
    assert all(model.get_submodule(n).weight.dtype == torch.float32 for n in LINEARS)
    kept = "raylm: {} linear layers ({}, ...) keep their weights dequantized in torch.float32: {}"
    assert sorted(caplog.messages) == [
        kept.format(
            2,
            "model.layers.0.mlp.gate_up_proj",
            "up_proj starts at row 128 of the fused weight, inside one of its 48x48 blocks",
        ),
        kept.format(
            2,
            "model.layers.0.self_attn.qkv_proj",
            "k_proj starts at row 64 of the fused weight, inside one of its 48x48 blocks",
        ),
        kept.format(
            4,
            "model.layers.0.self_attn.o_proj",
            "the FP8 block kernel steps through a tile's columns in powers of two of at least 32 that divide them, "
            "and 48 has none",
        ),
    ]


def test_a_fused_layer_whose_parts_are_laid_out_differently_stays_dequantized(tiny_model_dir, caplog):
    """Parts of one fused layer quantized in two layouts: one product cannot take both."""
    model = load_model(tiny_model_dir("llama"))
    mixed = ((("re:.*up_proj",), Fp8Scheme("channel", "")), (("Linear",), Fp8Scheme("block", "", (32, 32))))
    with caplog.at_level(logging.WARNING, logger="workers.quantization"):
        converted = fp8_products(model, WeightQuantization("fp8", mixed))
    assert "model.layers.0.mlp.gate_up_proj" not in converted and len(converted) == 6
    assert "quantized in different layouts (32x32 blocks, rows)" in caplog.text


def test_partly_unquantized_fused_layers_stay_dequantized(tiny_model_dir, caplog):
    # A fused layer converts only when every checkpoint module feeding it is quantized: up_proj left plain keeps
    # gate_up_proj in the model's dtype, the rest converts.
    model = load_model(tiny_model_dir("llama"))
    channel = Fp8Scheme("channel", "weight_scale")
    with caplog.at_level(logging.WARNING, logger="workers.quantization"):
        converted = fp8_products(model, WeightQuantization("fp8", ((("Linear",), channel),), (r"\.up_proj$",)))
    assert converted == [n for n in LINEARS if "gate_up" not in n]
    assert model.get_submodule("model.layers.1.mlp.gate_up_proj").weight.dtype == torch.float32
    [line] = caplog.messages
    assert "2 linear layers (model.layers.0.mlp.gate_up_proj, ...)" in line and "feeding them unquantized" in line


def test_a_shape_scaled_mm_cannot_take_stays_dequantized(caplog):
    model = torch.nn.Module()
    model.block = torch.nn.Module()
    model.block.proj = ColumnParallelLinear(24, {"proj": Shard(48, 0, 48, 0)}, bias=False)  # 24: not a multiple of 16
    model.block.out = RowParallelLinear(48, 32, bias=False, rank=0, tp_size=1)
    quantization = WeightQuantization("fp8", ((("Linear",), Fp8Scheme("channel", "")),), at_load=True)
    with caplog.at_level(logging.WARNING, logger="workers.quantization"):
        assert fp8_products(model, quantization) == ["block.out"]
    assert "torch._scaled_mm needs both dimensions multiples of 16, the weight is [48, 24]" in caplog.text


def test_a_gpu_without_fp8_keeps_the_weights_dequantized_and_says_why(tiny_model_dir, monkeypatch, caplog):
    path = tiny_model_dir("llama")
    model = load_model(path, quantization="fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with caplog.at_level(logging.WARNING, logger="workers.quantization"):
        quantization = read_model_spec(path, quantization="fp8").quantization
        fp8_products_where_supported(model, quantization, torch.device("cuda", 0), torch.bfloat16)
    assert all(model.get_submodule(n).weight_scale is None for n in LINEARS)
    assert caplog.messages == [
        "raylm: FP8 weights stay dequantized in torch.bfloat16 on cuda:0: compute capability 8.0 has no FP8 tensor "
        "cores (FP8 products need 8.9 or above)"
    ]


def test_lora_adds_to_an_fp8_layer_in_the_models_dtype(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"), quantization="fp8")
    layer = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    batch = LoraBatch([])
    # Slots made before the conversion, as the worker makes them: in the model's dtype.
    layer.lora = LinearLora(layer, max_loras=1, max_rank=4, batch=batch)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, generator=gen), torch.randn(32, 4, generator=gen)
    layer.lora.write(0, {"k_proj": (a, b)})
    fp8_products(model, read_model_spec(tiny_model_dir("llama"), quantization="fp8").quantization)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.lora.lora_a.dtype == torch.float32
    x = torch.randn(3, 64, generator=gen)
    batch.set(np.array([-1, -1, -1]))
    base = layer(x)
    batch.set(np.array([0, 0, 0]))
    adapted = layer(x)
    expected = base.clone()
    expected[:, 64:96] += x @ a.T @ b.T  # k_proj's rows
    torch.testing.assert_close(adapted, expected)


def _fp8_rank(rank: int, port: int, path: str, spec: ModelSpec, out_dir: str) -> None:
    """Tensor-parallel rank `rank` of 2 (gloo): its --quantization fp8 shard converted, its layers' FP8 weights and
    scales saved. `spec` is the parent's (transformers' import would double this rank's time)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = load_model(path, tp_rank=rank, tp_size=2, spec=spec)
        fp8_products(model, spec.quantization)
        torch.save(fp8_weights(model), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_models' ranks leave: torch's C++ teardown aborts now and then


def fp8_weights(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each linear's (FP8 weight, scales), detached from the parameters and their weight loaders (bound methods,
    which torch.load's weights-only unpickler refuses)."""
    return {n: (model.get_submodule(n).weight.detach(), model.get_submodule(n).weight_scale) for n in LINEARS}


def rank_rows(parts: list[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s half of the rows of each of a fused weight's parts (of `parts` rows each), as indices."""
    starts = itertools.accumulate([0, *parts[:-1]])
    return torch.cat([torch.arange(s + rank * n // 2, s + (rank + 1) * n // 2) for s, n in zip(starts, parts)])


def test_tensor_parallel_ranks_hold_the_whole_models_fp8_rows(tiny_model_dir, tmp_path):
    """Column-parallel ranks hold their rows of the whole model's FP8 weights and scales; row-parallel ranks hold
    their columns with the whole rows' scales (reduced over the ranks), not scales of their own halves."""
    path = tiny_model_dir("llama")
    spec = read_model_spec(path, 2, quantization="fp8")
    mp.spawn(_fp8_rank, args=(_free_port(), path, spec, str(tmp_path)), nprocs=2, join=True)
    full = fp8_weights(fp8_model(path, "fp8")[0])
    for r in (0, 1):
        for name, (weight, scale) in torch.load(tmp_path / f"{r}.pt").items():
            whole, whole_scale = full[name]
            if name.endswith(("o_proj", "down_proj")):
                cols = weight.shape[1]
                assert torch.equal(weight.float(), whole[:, r * cols : (r + 1) * cols].float()), name
                assert torch.equal(scale, whole_scale), name
                # Rows whose largest magnitude is the other rank's: a scale of this half's own would be smaller.
                assert bool((weight.float().abs().amax(dim=1) < 448).any()), name
            else:
                rows = rank_rows([64, 32, 32] if name.endswith("qkv_proj") else [128, 128], r)
                assert torch.equal(weight.float(), whole[rows].float()), name
                assert torch.equal(scale, whole_scale[rows]), name


def _block_rank(rank: int, port: int, path: str, spec: ModelSpec, out_dir: str) -> None:
    """Tensor-parallel rank `rank` of 2 (gloo): its 32x32-block shard converted, and the group's agreement on
    reasons to stay dequantized that one rank or none has."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = load_model(path, tp_rank=rank, tp_size=2, spec=spec)
        converted = fp8_products(model, spec.quantization)
        weights = {n: (model.get_submodule(n).weight.detach(), model.get_submodule(n).weight_scale) for n in converted}
        agreed = [_agreed("rank 0 cannot" if rank == 0 else None, "another rank cannot"), _agreed(None, "-")]
        torch.save((converted, weights, agreed), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_tensor_parallel_ranks_hold_their_slices_of_the_checkpoints_tiles(fp8_checkpoint, tmp_path):
    """32x32 tiles over 2 ranks: o_proj's and down_proj's column halves and gate_up_proj's row halves start on tile
    boundaries, so each rank holds the whole model's FP8 values and tile scales there; qkv_proj's k_proj half (16
    of 32 rows) cuts a tile and stays dequantized. A reason found on one rank keeps every rank dequantized."""
    _, path, _ = fp8_checkpoint("llama", "fp8 blocks 32x32")
    spec = read_model_spec(str(path), 2)
    mp.spawn(_block_rank, args=(_free_port(), str(path), spec, str(tmp_path)), nprocs=2, join=True)
    whole, _ = fp8_model(str(path))
    for r in (0, 1):
        converted, weights, agreed = torch.load(tmp_path / f"{r}.pt")
        assert converted == [n for n in LINEARS if "qkv" not in n]
        assert agreed == ["rank 0 cannot" if r == 0 else "another rank cannot", None]
        for name, (weight, scale) in weights.items():
            full = whole.get_submodule(name)
            if name.endswith(("o_proj", "down_proj")):
                cols = weight.shape[1]
                want = full.weight[:, r * cols : (r + 1) * cols]
                want_scale = full.weight_scale[:, r * cols // 32 : (r + 1) * cols // 32]
            else:
                rows = rank_rows([128, 128], r)
                want, want_scale = full.weight[rows], full.weight_scale[rows[::32] // 32]
            assert torch.equal(weight.float(), want.float()), name
            assert torch.equal(scale, want_scale), name
