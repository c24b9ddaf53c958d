"""Read a Hugging Face model directory (config.json + safetensors) into a `ModelSpec`, and build
and load this rank's shard of the model it describes."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from kernels import AttentionBackend, select_backend
from workers.layers import ROPE_TYPES, Attention, RopeConfig, TensorSlice, load_replicated
from workers.model_spec import ModelSpec, MoeSpec
from workers.models import MODEL_REGISTRY
from workers.quantization.checkpoint import read_weight
from workers.quantization.config import WeightQuantization, read_quantization

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# Keys of real MoE checkpoints' config.json that their transformers config class does not list as its own
# (older spellings, and fields this loader reads itself); any other unlisted key is refused by name.
KNOWN_MOE_CONFIG_KEYS = frozenset(
    {"num_experts", "torch_dtype", "rope_theta", "rope_scaling", "head_dim", "max_window_layers", "layer_types"}
    | {"is_matryoshka", "matryoshka_dimensions", "quantization_config"}
)


def _config_dir(path: str | Path) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"model path {str(path)!r} does not exist or is not a directory")
    if not (root / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json")
    return root


def _architecture(root: Path) -> str:
    architectures = json.loads((root / "config.json").read_text()).get("architectures") or []
    supported = [a for a in architectures if a in MODEL_REGISTRY]
    if not supported:
        raise ValueError(
            f"unsupported architecture {architectures} in {root / 'config.json'}; supported: {sorted(MODEL_REGISTRY)}"
        )
    return supported[0]


def _rope(cfg: PretrainedConfig) -> RopeConfig:
    params = dict(cfg.rope_parameters or {})
    rope_type = params.pop("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    theta = params.pop("rope_theta")
    scaling = tuple(sorted((k, float(v)) for k, v in params.items() if v is not None))
    return RopeConfig(float(theta), rope_type, scaling)


def _eos_ids(root: Path, cfg: PretrainedConfig) -> tuple[int, ...]:
    gen = root / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    ids: list[int] = []
    for value in (cfg.eos_token_id, gen_eos):
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _layer_windows(cfg: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window: `sliding_window` on the layers `layer_types` marks sliding_attention (all
    layers when the config has no layer_types); () when there is none."""
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return ()
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: ['full_attention', 'sliding_attention']")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _moe_spec(root: Path, architecture: str, cfg: PretrainedConfig) -> MoeSpec | None:
    """The experts of a MoE family, after refusing any config.json key the family's config class does not
    know: a new routing mode or a quantization this loader would ignore is never served approximately."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    known = set(type(cfg)().to_dict()) | KNOWN_MOE_CONFIG_KEYS
    unknown = sorted(set(json.loads((root / "config.json").read_text())) - known)
    if unknown:
        raise ValueError(f"{architecture}: config.json field {unknown[0]!r} is not supported by raylm's loader")
    experts = cfg.num_local_experts if architecture == "MixtralForCausalLM" else cfg.num_experts
    if not 1 <= cfg.num_experts_per_tok <= experts:
        raise ValueError(
            f"{architecture}: num_experts_per_tok={cfg.num_experts_per_tok} must be between 1 and the model's "
            f"{experts} experts"
        )
    layers = range(cfg.num_hidden_layers)
    if architecture == "MixtralForCausalLM":
        return MoeSpec(
            num_experts=experts,
            top_k=cfg.num_experts_per_tok,
            intermediate_size=cfg.intermediate_size,
            renormalize=True,
            sparse_layers=tuple(layers),
            block_name="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        )
    step = cfg.decoder_sparse_step
    sparse = tuple(i for i in layers if i not in cfg.mlp_only_layers and step > 0 and (i + 1) % step == 0)
    return MoeSpec(
        num_experts=experts,
        top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size,
        renormalize=bool(cfg.norm_topk_prob),
        sparse_layers=sparse,
    )


def _bias_flags(architecture: str, cfg: PretrainedConfig) -> dict[str, bool]:
    if architecture == "Qwen2ForCausalLM":
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "qk_norm": architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    }


def _matryoshka(cfg: PretrainedConfig) -> dict[str, Any]:
    widths = getattr(cfg, "matryoshka_dimensions", None) or ()
    if any(not isinstance(w, int) or not 0 < w <= cfg.hidden_size for w in widths):
        raise ValueError(f"config.json's matryoshka_dimensions={widths} must be widths in [1, {cfg.hidden_size}]")
    return {
        "is_matryoshka": bool(widths) or bool(getattr(cfg, "is_matryoshka", False)),
        "matryoshka_dimensions": tuple(widths),
    }


def read_model_spec(
    path: str | Path, tp_size: int = 1, expert_parallel: bool = False, quantization: str | None = None
) -> ModelSpec:
    """The spec of the model at `path`, its weights quantized at load by method `quantization` (`--quantization`)
    when the checkpoint is plain; ValueError naming the problem when the directory, its config, its architecture,
    its quantization or its split over `tp_size` ranks (whole experts per rank with `expert_parallel`) is not
    usable."""
    # Imported here: a rank takes its spec from the engine (WorkerConfig.model_spec), and transformers' import is
    # 1.6 CPU-s of a rank's 4 s start that it would otherwise pay for nothing.
    from transformers import AutoConfig

    root = _config_dir(path)
    architecture = _architecture(root)
    cfg = AutoConfig.from_pretrained(root)
    if cfg.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: ['silu']")
    eos_ids = _eos_ids(root, cfg)
    spec = ModelSpec(
        architecture=architecture,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope=_rope(cfg),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        bos_token_id=cfg.bos_token_id[0] if isinstance(cfg.bos_token_id, list) else cfg.bos_token_id,
        eos_token_id=eos_ids[0] if eos_ids else None,
        eos_token_ids=eos_ids,
        dtype=getattr(torch, cfg.dtype) if isinstance(cfg.dtype, str) else cfg.dtype,
        layer_windows=_layer_windows(cfg),
        moe=_moe_spec(root, architecture, cfg),
        quantization=read_quantization(root, quantization),
        **_bias_flags(architecture, cfg),
        **_matryoshka(cfg),
    )
    spec.check_tp(tp_size, expert_parallel)
    return spec


def _checkpoint_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return [root / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {root}")
    return files


def _checkpoint_names(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """checkpoint tensor name -> (parameter name, shard): fused parameters (qkv_proj) are fed
    by several checkpoint tensors (q_proj, k_proj, v_proj), each named as its shard. A module
    with a `checkpoint_names(prefix)` method (the experts) names its own parameters' tensors."""
    names: dict[str, tuple[str, Any]] = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "checkpoint_names"):
            names.update(module.checkpoint_names(prefix))
    claimed = {name for name, _ in names.values()}
    for name, _ in model.named_parameters():
        if name in claimed:
            continue
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        for shard in model.packed_modules.get(last, (None,)):
            names[f"{parent}.{shard}.{leaf}" if shard else name] = (name, shard)
    return names


def _open_checkpoint(files: contextlib.ExitStack, path: str | Path) -> dict[str, Any]:
    """Checkpoint tensor name -> the open safetensors file holding it (closed with `files`): a weight and its
    scale may lie in different files of a sharded checkpoint."""
    where = {}
    for file in _checkpoint_files(Path(path)):
        f = files.enter_context(safe_open(file, framework="pt", device="cpu"))
        where.update(dict.fromkeys(f.keys(), f))
    return where


def checkpoint_slices(
    files: contextlib.ExitStack, path: str | Path, names: Iterable[str], quantization: WeightQuantization | None
) -> Iterator[tuple[str, TensorSlice]]:
    """Each of checkpoint tensors `names` as the loaders read it (read_weight: a quantized one through its scales),
    lazily, from the checkpoint at `path` (its files closed with `files`); a ValueError naming those missing, before
    any is read."""
    where = _open_checkpoint(files, path)
    names = list(names)
    missing = sorted(set(names) - set(where))
    if missing:
        raise ValueError(f"weights missing from the checkpoint at {path}: {missing}")

    def lookup(name: str) -> Any:
        return where[name].get_slice(name) if name in where else None

    return ((name, read_weight(quantization, name, lookup)) for name in names)


def load_weights(
    model: nn.Module,
    path: str | Path,
    quantization: WeightQuantization | None = None,
    only: Collection[str] | None = None,
) -> None:
    """Copy this rank's slice of every checkpoint tensor the model uses (those of `only`, checkpoint names, where
    given) into its parameters, reading no more of each tensor than that slice (a quantized weight: that slice and
    its scales, dequantized). Tensors the model has no use for (rotary inv_freq, a tied lm_head, activation scales)
    are skipped; a missing or mis-shaped one, or one stored quantized where `quantization` does not say so, is a
    ValueError."""
    params = dict(model.named_parameters())
    wanted = _checkpoint_names(model)
    names = wanted if only is None else [n for n in wanted if n in only]
    with contextlib.ExitStack() as files:
        for ckpt_name, tensor in checkpoint_slices(files, path, names, quantization):
            name, shard = wanted[ckpt_name]
            param = params[name]
            loader = getattr(param, "weight_loader", load_replicated)
            loader(param, tensor, ckpt_name, shard)


def load_kv_scales(model: nn.Module, path: str | Path) -> None:
    """Each attention layer's FP8 KV scales from the checkpoint: `<layer>.self_attn.k_scale` and `v_scale`,
    one element each, as FP8 checkpoints with a quantized KV cache publish them (vLLM reads the same names); a
    checkpoint with none leaves them 1.0 and says so once. ValueError naming the tensor when only one of a layer's
    two is there, or one is not a single positive number."""
    layers = {name.rpartition(".")[0]: m for name, m in model.named_modules() if isinstance(m, Attention)}
    found = 0
    with contextlib.ExitStack() as files:
        where = _open_checkpoint(files, path)
        for prefix, layer in layers.items():
            names = [f"{prefix}.k_scale", f"{prefix}.v_scale"]
            present = [n for n in names if n in where]
            if not present:
                continue
            if len(present) == 1:
                raise ValueError(f"the checkpoint has {present[0]} but not {(set(names) - set(present)).pop()}")
            layer.k_scale, layer.v_scale = (_kv_scale(n, where[n].get_tensor(n)) for n in names)
            found += 1
    if not found:
        logger.warning(
            "kv_cache_dtype fp8: the checkpoint has no k_scale/v_scale tensors; every layer's KV is stored with "
            "scale 1.0 (keys and values past +-448 saturate)"
        )


def _kv_scale(name: str, tensor: torch.Tensor) -> float:
    value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
    if value is None or not value > 0:
        raise ValueError(f"KV scale {name} must be one positive number, got shape {list(tensor.shape)} {tensor}")
    return value


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created in the target dtype directly, never as fp32 copies converted later.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_backend: AttentionBackend | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_parallel: bool = False,
    quantization: str | None = None,
    spec: ModelSpec | None = None,
) -> nn.Module:
    """Build the model class config.json names and load rank `tp_rank`'s shard of its weights
    (its whole experts with `expert_parallel`, else its slice of every expert), quantized at load by method
    `quantization` (read_model_spec). `attn_backend` defaults to `select_backend("auto", device, dtype=dtype)`.
    `spec`: what `read_model_spec(path, tp_size, expert_parallel, quantization)` returns, where the caller has it
    already (a rank gets it from the engine); None reads it."""
    if spec is None:
        spec = read_model_spec(path, tp_size, expert_parallel, quantization)
    device = torch.device(device)
    backend = attn_backend if attn_backend is not None else select_backend("auto", device, dtype=dtype)
    with _default_dtype(dtype), device:
        model = MODEL_REGISTRY[spec.architecture](spec, backend, tp_rank, tp_size, expert_parallel)
    load_weights(model, path, spec.quantization)
    return model.eval()
