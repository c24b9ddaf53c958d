"""Read a Hugging Face model directory (config.json + safetensors) into a `ModelSpec`, and build
and load this rank's shard of the model it describes."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from kernels import AttentionBackend, select_backend
from workers.layers import ROPE_TYPES, RopeConfig, load_replicated
from workers.model_spec import ModelSpec
from workers.models import MODEL_REGISTRY


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


def _bias_flags(architecture: str, cfg: PretrainedConfig) -> dict[str, bool]:
    if architecture == "Qwen2ForCausalLM":
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "qk_norm": architecture == "Qwen3ForCausalLM",
    }


def read_model_spec(path: str | Path, tp_size: int = 1) -> ModelSpec:
    """The spec of the model at `path`; ValueError naming the problem when the directory,
    its config, its architecture or its split over `tp_size` ranks is not usable."""
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
        sliding_window=getattr(cfg, "sliding_window", None),
        **_bias_flags(architecture, cfg),
    )
    spec.check_tp(tp_size)
    return spec


def _checkpoint_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return [root / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {root}")
    return files


def _checkpoint_names(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """checkpoint tensor name -> (parameter name, shard): fused parameters (qkv_proj) are fed
    by several checkpoint tensors (q_proj, k_proj, v_proj), each named as its shard."""
    names: dict[str, tuple[str, str | None]] = {}
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        for shard in model.packed_modules.get(last, (None,)):
            names[f"{parent}.{shard}.{leaf}" if shard else name] = (name, shard)
    return names


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Copy this rank's slice of every checkpoint tensor the model uses into its parameters,
    reading no more of each tensor than that slice. Tensors the model has no use for (rotary
    inv_freq, a tied lm_head) are skipped; a missing or mis-shaped one is a ValueError."""
    params = dict(model.named_parameters())
    wanted = _checkpoint_names(model)
    missing = set(wanted)
    for file in _checkpoint_files(Path(path)):
        with safe_open(file, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if ckpt_name not in wanted:
                    continue
                name, shard = wanted[ckpt_name]
                param = params[name]
                loader = getattr(param, "weight_loader", load_replicated)
                loader(param, f.get_slice(ckpt_name), ckpt_name, shard)
                missing.discard(ckpt_name)
    if missing:
        raise ValueError(f"weights missing from the checkpoint at {path}: {sorted(missing)}")


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
) -> nn.Module:
    """Build the model class config.json names and load rank `tp_rank`'s shard of its weights.
    `attn_backend` defaults to `select_backend("auto", device, dtype=dtype)`."""
    spec = read_model_spec(path, tp_size)
    device = torch.device(device)
    backend = attn_backend if attn_backend is not None else select_backend("auto", device, dtype=dtype)
    with _default_dtype(dtype), device:
        model = MODEL_REGISTRY[spec.architecture](spec, backend, tp_rank, tp_size)
    load_weights(model, path)
    return model.eval()
