"""What the engine knows of a model, read once from config.json: its own module, so that the model classes
(workers/models/) and the loader that builds them (workers/model_loader.py) both import it and not each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.layers import RopeConfig

if TYPE_CHECKING:  # at run time the module would import this one back through the models
    from workers.quantization.config import WeightQuantization


@dataclass(slots=True, frozen=True)
class MoeSpec:
    """A mixture-of-experts feed-forward: `top_k` of `num_experts` SwiGLU experts (`intermediate_size` units
    each) per token, weighted by the router's softmax over all experts, renormalised over the chosen k when
    `renormalize` (Mixtral always; Qwen3-MoE with norm_topk_prob). The layers in `sparse_layers` have it, the
    others a dense MLP. Checkpoints name the block `block_name` and an expert's gate, up and down projections
    `expert_names` (Mixtral: block_sparse_moe, w1/w3/w2)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]
    block_name: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model, read once from config.json.
    `eos_token_id` is the first of the config's EOS ids; `eos_token_ids` holds all of them
    (config.json and generation_config.json), for stopping on any. `layer_windows[i]` is layer i's
    sliding window (a query sees its last that many positions, itself included) or None (all of
    them); empty when no layer has one. `moe` is None for a dense model. `is_matryoshka`: its embeddings keep
    their meaning when shortened to their first d dimensions (config.json's `is_matryoshka`, or its
    `matryoshka_dimensions`, which then lists the only widths allowed), as vLLM reads it. `quantization`: how
    the checkpoint's weights are quantized (None: plain); the model holds them dequantized all the same."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int | None, ...] = ()
    moe: MoeSpec | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    quantization: WeightQuantization | None = None

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def num_parameters(self) -> int:
        """The weights' count, from the shapes (norms and biases left out): attention, the MLPs (every expert of
        a sparse layer), the embeddings and the head unless tied. What a draft model's size is checked by."""
        h, moe = self.hidden_size, self.moe
        attention = h * 2 * (self.num_heads + self.num_kv_heads) * self.head_dim
        mlps = sum(
            moe.num_experts * 3 * h * moe.intermediate_size
            if moe is not None and layer in moe.sparse_layers
            else 3 * h * self.intermediate_size
            for layer in range(self.num_layers)
        )
        return self.num_layers * attention + mlps + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads one rank holds: an even share, or one replicated head when tp > num_kv_heads."""
        return max(self.num_kv_heads // tp_size, 1)

    def check_tp(self, tp_size: int, expert_parallel: bool = False) -> None:
        """Raise ValueError unless the heads, MLP and experts split evenly over `tp_size` ranks: each expert's
        units, or with `expert_parallel` the experts themselves (each rank holding whole experts)."""
        if expert_parallel and self.moe is None:
            raise ValueError(f"enable_expert_parallel: {self.architecture} is a dense model, it has no experts")
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_heads} is not divisible by tp_size={tp_size}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} and tp_size={tp_size}: neither divides the other")
        if self.intermediate_size % tp_size:
            problems.append(f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp_size}")
        moe = self.moe
        if moe is not None and expert_parallel and moe.num_experts % tp_size:
            problems.append(f"num_experts={moe.num_experts} is not divisible by tp_size={tp_size} (expert parallel)")
        if moe is not None and not expert_parallel and moe.intermediate_size % tp_size:
            problems.append(
                f"moe_intermediate_size={moe.intermediate_size} is not divisible by tp_size={tp_size} "
                "(tensor parallel inside each expert; --enable-expert-parallel splits whole experts instead)"
            )
        if problems:
            raise ValueError(f"cannot split {self.architecture} over {tp_size} ranks: " + "; ".join(problems))
