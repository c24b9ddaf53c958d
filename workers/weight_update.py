"""Weights pushed into a loaded model from outside its start-up checkpoint (RL rollouts, issue #71): named full
tensors from a trainer, or another checkpoint on disk, through the same weight loaders the start-up load runs."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.fp8 import fp8_values
from workers.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorSlice,
    VocabParallelEmbedding,
    load_replicated,
    pack_weight,
)
from workers.model_loader import _checkpoint_names, checkpoint_slices, load_weights
from workers.models.moe import SparseMoeBlock
from workers.parallel import MissingLayer
from workers.quantization.checkpoint import read_weight
from workers.quantization.config import read_quantization
from workers.quantization.conversion import _to_fp8

# safetensors' names of torch's floating dtypes, which read_weight checks a plain weight against.
SAFETENSORS_DTYPES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
}
# What a weight loader sets on its module besides the parameter it writes (a quantized checkpoint's scales):
# staging restores them, so an update changes nothing but the parameters it commits.
LOADER_STATE = ("input_scale", "checkpoint_scales", "_input_scales", "_row_scales")
LOADER_STATE += ("w13_input_scale", "w2_input_scale", "_static")


@dataclass(slots=True)
class TensorView:
    """A torch tensor read as a TensorSlice (what safetensors' get_slice gives the loaders), so that a pushed tensor
    takes the path a checkpoint's does and each rank cuts its own shard exactly as it did at start-up."""

    tensor: torch.Tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return SAFETENSORS_DTYPES.get(self.tensor.dtype, str(self.tensor.dtype))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


@dataclass(slots=True)
class StagedUpdate:
    """An update staged and checked, nothing of the model changed yet.

    `loads`: the loader calls (raylm parameter name, checkpoint name, tensor, shard) of the parameters of plain layers,
    already run once against meta tensors of the parameters' shapes, which checks every shape and copies nothing;
    commit runs them into the parameters. So staging holds no second copy of the weights it updates (the clones it
    once made cost a third of a push's time). `params`: for layers that hold FP8 products, a clone of each parameter
    holding the update's rows and its own others (k and v of a fused qkv_proj whose q_proj alone came), dequantized,
    which commit requantizes: their new values must exist before the layer's scales can change. `written`: the
    checkpoint names the update wrote."""

    loads: list[tuple[str, str, TensorSlice, Any]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)


def pushed_slices(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, TensorSlice]:
    """The pushed tensors this rank loads, by checkpoint name, as the loaders read them. Skipped: a tied model's
    lm_head.weight (the embedding is the head: its own update reaches it), and the weights of other pipeline stages'
    layers and other ranks' experts (each rank takes its own). ValueError naming the tensor for an unknown name, a
    dtype that is not floating point, or a tied lm_head of another shape than the embedding's."""
    wanted = _checkpoint_names(model)
    elsewhere = _held_elsewhere(model)
    missing = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, MissingLayer))
    quantization = model.spec.quantization
    at_load = quantization if quantization is not None and quantization.at_load else None
    slices = {}
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"weight update {name}: {what} is not a floating-point tensor")
        if name in wanted:
            # A plain model's weights as pushed; one quantized at load (--quantization fp8) rounds them as it did.
            slices[name] = read_weight(at_load, name, {name: TensorView(tensor)}.get)
        elif name == "lm_head.weight" and model.spec.tie_word_embeddings:
            _check_tied_head(model, tensor)
        elif name not in elsewhere and not name.startswith(missing):
            raise ValueError(
                f"weight update {name}: {model.spec.architecture} has no such weight (updates name the Hugging Face "
                "checkpoint's tensors, e.g. model.layers.0.self_attn.q_proj.weight)"
            )
    return slices


def _check_tied_head(model: nn.Module, tensor: torch.Tensor) -> None:
    spec = model.spec
    if list(tensor.shape) != [spec.vocab_size, spec.hidden_size]:
        raise ValueError(
            f"weight update lm_head.weight has shape {list(tensor.shape)}, expected [{spec.vocab_size}, "
            f"{spec.hidden_size}] (the head is tied to model.embed_tokens.weight, whose update it takes)"
        )


def _held_elsewhere(model: nn.Module) -> set[str]:
    return {
        name
        for prefix, m in model.named_modules()
        if isinstance(m, SparseMoeBlock)
        for name in m.foreign_expert_names(prefix)
    }


def stage(model: nn.Module, slices: Iterable[tuple[str, TensorSlice]], dtype: torch.dtype) -> StagedUpdate:
    """Run each slice's weight loader into a meta tensor of its parameter's shape, or for a layer holding FP8 products
    into a clone of its parameter dequantized into `dtype`. The loaders check every shape (ValueError naming the
    tensor); the model's parameters and loader state are as before, whether staging succeeds or not."""
    params = dict(model.named_parameters())
    wanted = _checkpoint_names(model)
    staged = StagedUpdate()
    targets: dict[str, torch.Tensor] = {}
    with _loader_state_kept(model):
        for ckpt_name, tensor in slices:
            name, shard = wanted[ckpt_name]
            param = params[name]
            if name not in targets:
                targets[name] = _staging_target(model, name, param, dtype)
                if not targets[name].is_meta:
                    staged.params[name] = targets[name]
            try:
                _loader(param)(targets[name], tensor, ckpt_name, shard)
            except ValueError as e:
                raise ValueError(f"weight update refused: {e}") from e
            if targets[name].is_meta:
                staged.loads.append((name, ckpt_name, tensor, shard))
            staged.written.add(ckpt_name)
    return staged


def _loader(param: torch.Tensor) -> Callable[..., None]:
    return getattr(param, "weight_loader", load_replicated)


@contextlib.contextmanager
def _loader_state_kept(model: nn.Module):
    """Whatever the loaders run meanwhile set on their modules besides the parameters (LOADER_STATE) is put back."""
    state = [(m, a, copy.copy(getattr(m, a))) for m in model.modules() for a in LOADER_STATE if hasattr(m, a)]
    try:
        yield
    finally:
        for module, attr, value in state:
            setattr(module, attr, value)


def _holds_fp8_products(module: nn.Module) -> bool:
    return getattr(module, "weight_scale", None) is not None or getattr(module, "w13_scale", None) is not None


def _staging_target(model: nn.Module, name: str, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the loaders write into for `param` while staging (StagedUpdate)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if not _holds_fp8_products(module):
        return torch.empty_like(param, device="meta")
    if param.dtype != torch.float8_e4m3fn:
        return param.detach().clone()
    scale = getattr(module, "weight_scale" if leaf == "weight" else f"{leaf}_scale")
    return fp8_values(param.detach(), scale, module.weight_block).to(dtype)


def commit(model: nn.Module, staged: StagedUpdate, pack: bool, dtype: torch.dtype, fresh_scales: bool) -> None:
    """Run the staged loads into the parameters, in place (CUDA decode graphs read them at their addresses), and
    requantize the staged FP8 layers into their own tensors; then bring each touched layer's CPU-packed weight along
    where `pack` (workers.layers.pack_for_cpu). `fresh_scales`: the values are not the checkpoint's, so FP8 rows
    take their own maxima, not the scales the checkpoint stored them with. A lazily read checkpoint's files must
    still be open."""
    params = dict(model.named_parameters())
    with _loader_state_kept(model):
        for name, ckpt_name, tensor, shard in staged.loads:
            _loader(params[name])(params[name], tensor, ckpt_name, shard)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in staged.params.items():
        module_name, _, leaf = name.rpartition(".")
        by_module.setdefault(module_name, {})[leaf] = value
    for module_name, values in by_module.items():
        module = model.get_submodule(module_name)
        if getattr(module, "weight_scale", None) is not None:
            _requantize_linear(module, values, fresh_scales)
        else:
            _requantize_experts(model, module_name, module, values, dtype, fresh_scales)
    if pack:
        for module_name in {name.rpartition(".")[0] for name, *_ in staged.loads} | set(by_module):
            repack(model, model.get_submodule(module_name))


def repack(model: nn.Module, module: nn.Module) -> None:
    """`module`'s CPU-packed copy made again from its weight (pack_for_cpu's, for one layer)."""
    if isinstance(module, ColumnParallelLinear | RowParallelLinear):
        module.packed = pack_weight(module.weight)
    elif isinstance(module, VocabParallelEmbedding) and module is model.lm_head:
        module.packed_head = pack_weight(module.weight)


def _requantize_linear(layer: nn.Module, values: dict[str, torch.Tensor], fresh_scales: bool) -> None:
    """A FP8 linear layer's staged values (its weight dequantized, maybe its bias) requantized as fp8_products did,
    into its own tensors."""
    if "bias" in values:
        layer.bias.data.copy_(values["bias"])
    if "weight" not in values:
        return
    weight, scale = layer.weight, layer.weight_scale
    if fresh_scales:
        layer.checkpoint_scales = None
    layer.weight = nn.Parameter(values["weight"], requires_grad=False)  # what _to_fp8 converts
    layer.weight.weight_loader = weight.weight_loader
    _to_fp8(layer, layer.weight_block)
    weight.data.copy_(layer.weight)
    scale.copy_(layer.weight_scale)
    layer.weight, layer.weight_scale = weight, scale


def _requantize_experts(
    model: nn.Module,
    name: str,
    moe: SparseMoeBlock,
    values: dict[str, torch.Tensor],
    dtype: torch.dtype,
    fresh_scales: bool,
) -> None:
    """A FP8 MoE block's staged experts requantized (SparseMoeBlock.to_fp8 converts w13 and w2 together, so the one
    not staged is dequantized too), into its own tensors; its router is a plain layer of its own, loaded as any."""
    old = (moe.w13, moe.w2, moe.w13_scale, moe.w2_scale)
    w13, w2 = (
        values[leaf] if leaf in values else _staging_target(model, f"{name}.{leaf}", p, dtype)
        for leaf, p in zip(("w13", "w2"), old)
    )
    if fresh_scales:
        moe._row_scales.clear()
    moe.w13, moe.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
    moe.to_fp8(moe.weight_block)
    for target, value in zip(old, (moe.w13, moe.w2, moe.w13_scale, moe.w2_scale)):
        target.data.copy_(value)
    moe.w13, moe.w2, moe.w13_scale, moe.w2_scale = old


def holds_fp8(model: nn.Module) -> bool:
    return any(p.dtype == torch.float8_e4m3fn for p in model.parameters())


def update_weights(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, pack: bool
) -> set[str]:
    """Pushed full tensors by checkpoint name, all or none (pushed_slices, stage, commit); the checkpoint names
    this rank wrote."""
    staged = stage(model, pushed_slices(model, named_tensors).items(), dtype)
    commit(model, staged, pack, dtype, fresh_scales=True)
    return staged.written


def update_weights_from_disk(model: nn.Module, path: str | Path, dtype: torch.dtype, pack: bool) -> set[str]:
    """Every weight this rank holds from the checkpoint at `path`, all or none; quantized as its own config says (or
    at load, as the model's start-up checkpoint was)."""
    start = model.spec.quantization
    quantization = read_quantization(Path(path), start.method if start is not None and start.at_load else None)
    with contextlib.ExitStack() as files:  # open until commit has run the loads
        staged = stage(model, checkpoint_slices(files, path, _checkpoint_names(model), quantization), dtype)
        commit(model, staged, pack, dtype, fresh_scales=True)
    return staged.written


def reload(model: nn.Module, path: str | Path, only: set[str], dtype: torch.dtype, pack: bool) -> None:
    """Checkpoint tensors `only` read back from the start-up checkpoint at `path` (after weights were freed). Straight
    into the parameters, as the start-up load does, unless the model holds FP8 products: those are staged and
    requantized, at the checkpoint's own scales."""
    if not only:
        return
    if holds_fp8(model):
        with contextlib.ExitStack() as files:
            staged = stage(model, checkpoint_slices(files, path, sorted(only), model.spec.quantization), dtype)
            commit(model, staged, pack, dtype, fresh_scales=False)
        return
    load_weights(model, path, model.spec.quantization, only)
    if pack:
        wanted = _checkpoint_names(model)
        for module_name in {wanted[name][0].rpartition(".")[0] for name in only}:
            repack(model, model.get_submodule(module_name))


def get_weight(model: nn.Module, name: str) -> torch.Tensor:
    """A CPU copy of this rank's parameter `name` (raylm's name: model.layers.0.self_attn.qkv_proj.weight); ValueError
    naming it when the model has none."""
    params = dict(model.named_parameters())
    if name not in params:
        raise ValueError(f"no parameter {name} on this rank (names are raylm's, e.g. {next(iter(params))})")
    return params[name].detach().to("cpu", copy=True)
