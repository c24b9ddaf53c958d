"""LoRA adapters in PEFT's format: read and checked against the base model, held in host memory, and copied into
a few resident slots of each adapted layer (an LRU) when a step needs them."""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from kernels.lora import LoraBatch, add_lora
from workers.layers import ColumnParallelLinear, RowParallelLinear
from workers.model_spec import ModelSpec

T = TypeVar("T")
# checkpoint module -> (the block holding it, the fused layer of ours it feeds)
LORA_TARGETS = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
# The tensors of an adapter of the vocabulary modules (which raylm does not adapt), and their vocabulary's dim: a
# different vocabulary says a different base model, a more useful refusal than "not supported".
_VOCAB_DIMS = {"lm_head.lora_B": 0, "embed_tokens.lora_embedding_A": 1}


@dataclass(slots=True)
class LoraAdapter:
    """One adapter, whole (every rank's slices), in host memory: ``weights[(layer, module)] = (A [r, in],
    B [out, r] times the adapter's scaling)``, modules named as the checkpoint names them (q_proj, ...)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _refuse(name: str, problem: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {problem}")


def _check_base(name: str, config: dict, spec: ModelSpec) -> None:
    """The base model the adapter was trained on, where its config.json is at hand: same architecture, hidden
    size and vocabulary as the model served."""
    base = config.get("base_model_name_or_path")
    base_config = Path(base) / "config.json" if base else None
    if base_config is None or not base_config.is_file():
        return
    cfg = json.loads(base_config.read_text())
    architectures = cfg.get("architectures") or []
    if spec.architecture not in architectures:
        raise _refuse(name, f"base architecture {architectures} does not match the model's {spec.architecture}")
    for field, ours in (("hidden_size", spec.hidden_size), ("vocab_size", spec.vocab_size)):
        if cfg.get(field) != ours:
            raise _refuse(name, f"base model's {field} is {cfg.get(field)}, the served model's is {ours}")


def _read_config(name: str, root: Path) -> dict:
    if not root.is_dir():
        raise _refuse(name, f"path {str(root)!r} does not exist or is not a directory")
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        if not (root / file).is_file():
            raise _refuse(name, f"path {str(root)!r} has no {file}")
    config = json.loads((root / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, ok in (("use_dora", False), ("bias", "none"), ("alpha_pattern", {})):
        if config.get(key, ok) not in (ok, None):
            raise _refuse(name, f"{key}={config[key]!r} is not supported")
    if config.get("modules_to_save"):
        raise _refuse(name, f"modules_to_save={config['modules_to_save']!r} is not supported")
    return config


def _module_of(name: str, key: str, tensor: torch.Tensor, spec: ModelSpec) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None:
        vocab_dim = next((dim for part, dim in _VOCAB_DIMS.items() if part in key), None)
        if vocab_dim is not None and tensor.shape[vocab_dim] != spec.vocab_size:
            raise _refuse(
                name,
                f"{key} has shape {list(tensor.shape)}: a vocabulary of {tensor.shape[vocab_dim]}, the model's is "
                f"{spec.vocab_size}",
            )
        raise _refuse(name, f"tensor {key} adapts a module raylm's LoRA does not: only {sorted(LORA_TARGETS)}")
    layer, block, module, which = int(match[1]), match[2], match[3], match[4]
    if module not in LORA_TARGETS or LORA_TARGETS[module][0] != block:
        raise _refuse(
            name,
            f"targets module {block}.{module}, which the model does not have (LoRA applies to {sorted(LORA_TARGETS)})",
        )
    if layer >= spec.num_layers:
        raise _refuse(name, f"targets layer {layer}, the model has {spec.num_layers}")
    if block == "mlp" and spec.moe is not None and layer in spec.moe.sparse_layers:
        raise _refuse(name, f"targets mlp.{module} of layer {layer}, which the model does not have (experts)")
    return layer, module, which


def target_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each target module's (out, in) in the unsharded model."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


def read_adapter(name: str, path: str, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    """The adapter at `path`, checked against the model `spec` describes; a ValueError naming the adapter and the
    mismatch otherwise."""
    root = Path(path)
    config = _read_config(name, root)
    _check_base(name, config, spec)
    tensors = load_file(root / "adapter_model.safetensors")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, which = _module_of(name, key, tensor, spec)
        parts.setdefault((layer, module), {})[which] = tensor
    shapes = target_shapes(spec)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    weights, top_rank = {}, 0
    for (layer, module), ab in sorted(parts.items()):
        missing = sorted({"A", "B"} - set(ab))
        if missing:
            raise _refuse(name, f"layers.{layer}.{module} has no lora_{missing[0]}")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[module]
        r = a.shape[0]
        if a.shape[1] != inp or b.shape[0] != out or b.shape[1] != r:
            raise _refuse(
                name,
                f"layers.{layer}.{module} has A {list(a.shape)} and B {list(b.shape)}: the model's {module} is "
                f"[{out}, {inp}] (hidden size {spec.hidden_size}): a different base model",
            )
        if r > max_rank:
            raise _refuse(name, f"rank {r} is above max_lora_rank={max_rank}")
        scaling = alpha / (math.sqrt(r) if rslora else r)
        weights[(layer, module)] = (a.float(), b.float() * scaling)
        top_rank = max(top_rank, r)
    if not weights:
        raise _refuse(name, "adapter_model.safetensors holds no LoRA weights")
    return LoraAdapter(name, str(path), top_rank, weights)


class LinearLora:
    """The adapter slots of one fused layer of this rank: ``lora_a`` [slots, n * R, in_rank] and per checkpoint
    module j ``lora_bs[j]`` [slots, R, size_j], sliced like the layer (column-parallel: B's columns of this rank's
    shard, A whole; row-parallel: A's columns of this rank's input slice, B whole, the partial products summed by
    the layer's all-reduce). A slot holding no adapter for this layer is zeros."""

    def __init__(self, layer: nn.Module, max_loras: int, max_rank: int, batch: LoraBatch):
        self.layer, self.batch = layer, batch
        dtype, device = layer.weight.dtype, layer.weight.device
        self.rank = max_rank
        if isinstance(layer, ColumnParallelLinear):
            self.modules = list(layer.shards)
            sizes = [s.size for s in layer.shards.values()]
            self.offsets = [s.offset for s in layer.shards.values()]
            in_size = layer.weight.shape[1]
        else:
            self.modules = [None]
            sizes = [layer.output_size]
            self.offsets = [0]
            in_size = layer.input_size // layer.tp_size
        n = len(self.modules)
        self.lora_a = torch.zeros(max_loras, n * max_rank, in_size, dtype=dtype, device=device)
        self.lora_bs = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for size in sizes]

    def write(self, slot: int, parts: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds `parts` (checkpoint module -> A, B; None for a row-parallel layer's one module)."""
        self.lora_a[slot].zero_()
        for b in self.lora_bs:
            b[slot].zero_()
        layer, R = self.layer, self.rank
        for j, module in enumerate(self.modules):
            if module not in parts:
                continue
            a, b = parts[module]
            r = a.shape[0]
            if module is None:  # row-parallel: this rank's input columns
                cols = self.lora_a.shape[2]
                a = a[:, layer.rank * cols : (layer.rank + 1) * cols]
            else:
                s = layer.shards[module]
                b = b[s.start : s.start + s.size]
            self.lora_a[slot, j * R : j * R + r].copy_(a)
            self.lora_bs[j][slot, :r].copy_(b.T)

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += the step's adapter products. On CUDA the op runs in every step, the base model's alone too (its
        tokens read no adapter weights): a captured graph holds it whatever the step's adapters."""
        token_slots = self.batch.token_slots
        if token_slots is not None:
            from kernels.triton_lora import triton_add_lora  # triton only where it runs

            triton_add_lora(y, x, self.lora_a, self.lora_bs, self.offsets, token_slots[: x.shape[0]])
        elif self.batch.runs:
            add_lora(y, x, self.lora_a, self.lora_bs, self.offsets, self.batch)


class LoraManager:
    """This rank's adapters: every registered one in host memory (``adapters``), at most ``max_loras`` of them
    resident in the layers' slots. ``slots`` maps resident adapter names to slots in least- to most-recently used
    order; a step's adapters are made resident (evicting the least recently used ones the step does not use)
    before its forward. The scheduler never puts more than ``max_loras`` adapters in one step."""

    def __init__(self, model: nn.Module, spec: ModelSpec, max_loras: int, max_rank: int) -> None:
        self.spec, self.max_loras, self.max_rank = spec, max_loras, max_rank
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: OrderedDict[str, int] = OrderedDict()
        self.layers: dict[tuple[int, str], LinearLora] = {}
        self.batch = LoraBatch([])
        for name, module in model.named_modules():
            match = re.match(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$", name)
            if match and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.lora = self.layers[(int(match[1]), match[3])] = LinearLora(
                    module, max_loras, max_rank, self.batch
                )

    def add(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise _refuse(name, "an adapter of this name is already loaded")
        self.adapters[name] = read_adapter(name, path, self.spec, self.max_rank)

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise _refuse(name, "no adapter of this name is loaded")
        self.slots.pop(name, None)

    def _slot(self, name: str, step: set[str]) -> int:
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        if name not in self.adapters:
            raise _refuse(name, "no adapter of this name is loaded")
        if len(self.slots) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self.slots.values()))
        else:
            victim = next(n for n in self.slots if n not in step)
            slot = self.slots.pop(victim)
        by_layer: dict[tuple[int, str], dict] = {}
        for (layer, module), ab in self.adapters[name].weights.items():
            fused = LORA_TARGETS[module][1]
            by_layer.setdefault((layer, fused), {})[None if fused in ("o_proj", "down_proj") else module] = ab
        for key, lora in self.layers.items():
            lora.write(slot, by_layer.get(key, {}))
        self.slots[name] = slot
        return slot

    def group(self, states: list[T]) -> tuple[list[T], np.ndarray]:
        """A step's requests (anything with a ``lora_name``; None: the base model) with their adapters made
        resident, reordered by slot, the base model's first, and each one's slot (-1: the base model): each
        adapter's tokens are then one run of rows, which the torch LoRA op slices instead of gathering and
        scattering them in every layer."""
        step = {s.lora_name for s in states if s.lora_name is not None}
        slot_of = {n: self._slot(n, step) for n in step}
        slots = [slot_of.get(s.lora_name, -1) for s in states]
        order = sorted(range(len(states)), key=slots.__getitem__)
        return [states[i] for i in order], np.fromiter((slots[i] for i in order), dtype=np.int64, count=len(order))
