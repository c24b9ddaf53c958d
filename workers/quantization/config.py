"""A checkpoint's quantization_config, resolved per layer (`WeightQuantization`, `read_quantization`): what
workers/quantization/__init__.py says is read and refused. Imports no model, so the model spec can name it."""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

SUPPORTED_METHODS = ("fp8", "compressed-tensors (float 8-bit weights)")
AT_LOAD_METHODS = ("fp8",)  # --quantization's values: engine.config.choices.QUANTIZATIONS
STRATEGIES = ("tensor", "channel", "block")
# The activations a compressed-tensors group may quantize (input_activations): block weights take dynamic ones.
ACTIVATIONS = ("float 8-bit dynamic", "float 8-bit static per tensor (with tensor or channel weights)")
# Files that older tools write beside config.json instead of a quantization_config: their method, named.
QUANT_CONFIG_FILES = {"quantize_config.json": "gptq", "hf_quant_config.json": "modelopt"}


@dataclass(slots=True, frozen=True)
class Fp8Scheme:
    """How a quantized layer's weight [out, in] is stored: float8_e4m3fn with the scale tensor
    `<layer>.<scale_name>`, one scale for the whole weight (`tensor`), one per output row (`channel`) or one per
    `block` [rows, cols] tile (`block`; the last tiles of a dimension the block does not divide are smaller).
    `static`: its activations are quantized with one fixed scale, the checkpoint's `<layer>.input_scale` (never
    with block scales); else per token as they come."""

    strategy: str
    scale_name: str
    block: tuple[int, int] | None = None
    static: bool = False

    def scale_grid(self, name: str, scale: torch.Tensor, out: int, cols: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """The scales as a float32 grid [ceil(out / rows), ceil(in / cols)] and the tile [rows, cols] each covers;
        ValueError naming the scale tensor when its shape is not the one this scheme gives a [out, in] weight."""
        if self.strategy == "tensor":
            expected, tile, ok = "one element", (out, cols), scale.numel() == 1
        elif self.strategy == "channel":
            expected, tile = f"[{out}] or [{out}, 1]", (1, cols)
            ok = tuple(scale.shape) in ((out,), (out, 1))
        else:
            tile = self.block
            grid = (-(-out // tile[0]), -(-cols // tile[1]))
            expected, ok = str(list(grid)), tuple(scale.shape) == grid
        if not ok:
            raise ValueError(
                f"scale tensor {name} has shape {list(scale.shape)} in the checkpoint, expected {expected} "
                f"({self.strategy} scales of a [{out}, {cols}] weight)"
            )
        return scale.to(torch.float32).reshape(-(-out // tile[0]), -(-cols // tile[1])), tile


@dataclass(slots=True, frozen=True)
class WeightQuantization:
    """A checkpoint's quantization_config, resolved: a linear layer takes the scheme of the first of `groups`
    whose targets it matches ("Linear": every linear layer; a layer's name; "re:" and a regex matched from its
    start), unless a pattern of `ignore` (regexes, searched in the layer's name) names it: then its weight is a
    plain one. `method` is the config's quant_method, for messages. `at_load`: the checkpoint is a plain one, and
    the layers with a scheme are quantized per output channel as they load (`--quantization fp8`)."""

    method: str
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    ignore: tuple[str, ...] = ()
    at_load: bool = False

    def scheme(self, layer: str) -> Fp8Scheme | None:
        if any(re.search(pattern, layer) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_targets(t, layer) for t in targets):
                return scheme
        return None


def _targets(target: str, layer: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], layer) is not None
    return target == layer


def read_quantization(root: Path, requested: str | None = None) -> WeightQuantization | None:
    """The weight quantization of the checkpoint in directory `root` (its config.json's quantization_config), None
    for a plain checkpoint; ValueError naming the method (and listing the supported ones) for anything else.
    `requested` (`--quantization`): a plain checkpoint is quantized at load by that method; a quantized one must
    already be quantized by it."""
    checkpoint = _checkpoint_quantization(root)
    if requested is None:
        return checkpoint
    if requested not in AT_LOAD_METHODS:
        _refuse(requested, " (--quantization)", AT_LOAD_METHODS)
    if checkpoint is None:
        # The LM head and MoE routers stay plain, as vLLM leaves them.
        ignore = ("lm_head", r"\.gate$")
        return WeightQuantization(requested, ((("Linear",), Fp8Scheme("channel", "")),), ignore, at_load=True)
    if checkpoint.method != requested:
        raise ValueError(
            f"--quantization {requested} was asked for, but the checkpoint's quantization_config is "
            f"{checkpoint.method}: serve it without --quantization (its own quantization is read), or quantize an "
            "unquantized checkpoint"
        )
    return checkpoint


def _checkpoint_quantization(root: Path) -> WeightQuantization | None:
    config = json.loads((root / "config.json").read_text())
    for file, method in QUANT_CONFIG_FILES.items():
        if (root / file).is_file() and "quantization_config" not in config:
            _refuse(method, f" ({file})")
    quant = config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    _refuse(method)


def _refuse(method: Any, detail: str = "", supported: tuple[str, ...] = SUPPORTED_METHODS) -> NoReturn:
    raise ValueError(
        f"quantization method {method!r}{detail} is not supported; supported: {list(supported)}. "
        "A quantized checkpoint is never loaded as if its weights were plain ones"
    )


def _block(value: Any, what: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"quantization_config {what}={value!r} must be two positive integers [rows, cols]")
    return tuple(value)


def _fp8(quant: dict[str, Any]) -> WeightQuantization:
    """transformers' and vLLM's `fp8`: every linear layer but lm_head and those `modules_to_not_convert` or
    `ignored_layers` name (as transformers matches them: a substring of the layer's name, "*" for layer numbers)."""
    activations = quant.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {activations!r} is not supported; supported: ['dynamic', 'static']")
    if quant.get("fmt", "e4m3") != "e4m3":
        _refuse("fp8", f" with fmt={quant['fmt']!r}")
    block = quant.get("weight_block_size")
    static = activations == "static"
    if block is None:
        scheme = Fp8Scheme("tensor", "weight_scale", static=static)
    elif static:
        raise ValueError(
            "fp8 activation_scheme 'static' with weight_block_size is not supported: block-wise FP8 weights are "
            "read with dynamic activations only (quantized per token and group of the block's columns), as vLLM "
            "reads them"
        )
    else:
        scheme = Fp8Scheme("block", "weight_scale_inv", _block(block, "weight_block_size"))
    skipped = ["lm_head", *(quant.get("modules_to_not_convert") or ()), *(quant.get("ignored_layers") or ())]
    ignore = tuple(re.escape(m).replace(r"\*", r"\d+") for m in skipped)
    return WeightQuantization("fp8", ((("Linear",), scheme),), ignore)


def _compressed_tensors(quant: dict[str, Any]) -> WeightQuantization:
    """compressed-tensors: each of `config_groups` names its target layers and how their weights are quantized;
    only float 8-bit weights (float-quantized or naive-quantized, symmetric) are read. `ignore` lists layer names
    and "re:" regexes."""
    sparsity = (quant.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        _refuse("compressed-tensors", f" with sparsity format {sparsity!r}")
    groups = []
    for group_name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind = f"{weights.get('type')} {weights.get('num_bits')}-bit weights"
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            _refuse("compressed-tensors", f" with {kind} (group {group_name!r})")
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            _refuse(
                "compressed-tensors", f" with {kind} and strategy {strategy!r}; strategies read: {list(STRATEGIES)}"
            )
        if weights.get("symmetric") is False:
            _refuse("compressed-tensors", f" with asymmetric {kind} (zero points)")
        fmt = group.get("format") or quant.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            _refuse("compressed-tensors", f" with format {fmt!r}")
        block = _block(weights.get("block_structure"), "block_structure") if strategy == "block" else None
        static = _static_activations(group_name, group.get("input_activations"), block)
        groups.append((tuple(group.get("targets") or ()), Fp8Scheme(strategy, "weight_scale", block, static)))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups: nothing says how it is stored")
    ignore = tuple(f"^(?:{p[3:]})" if p.startswith("re:") else f"^{re.escape(p)}$" for p in quant.get("ignore") or ())
    return WeightQuantization("compressed-tensors", tuple(groups), ignore)


def _static_activations(group_name: str, activations: dict[str, Any] | None, block: tuple[int, int] | None) -> bool:
    """Whether compressed-tensors group `group_name` quantizes its `input_activations` statically, with one scale per
    tensor (`input_scale`), rather than dynamically (per token as they come, as raylm's FP8 products also do where
    the group has none); ValueError naming the scheme for any other."""
    if activations is None:
        return False
    dynamic = activations.get("dynamic")
    static = dynamic is False
    if (
        (activations.get("type"), activations.get("num_bits")) != ("float", 8)
        or activations.get("symmetric") is False
        or dynamic not in (True, False)
        or (static and (activations.get("strategy") != "tensor" or block is not None))
    ):
        scheme = (
            f"{activations.get('type')} {activations.get('num_bits')}-bit, dynamic={dynamic!r}, "
            f"strategy={activations.get('strategy')!r}, symmetric={activations.get('symmetric', True)!r}"
        )
        raise ValueError(
            f"compressed-tensors input_activations ({scheme}; group {group_name!r}"
            f"{', block weights' if block is not None else ''}) are not supported; supported: {list(ACTIVATIONS)}"
        )
    return static
