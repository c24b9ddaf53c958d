"""What the engine knows of a model, read once from config.json: its own module, so that the model classes
(workers/models/) and the loader that builds them (workers/model_loader.py) both import it and not each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.layers import RopeConfig


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model, read once from config.json.
    `eos_token_id` is the first of the config's EOS ids; `eos_token_ids` holds all of them
    (config.json and generation_config.json), for stopping on any. `sliding_window` is reported
    but not applied by the attention kernels: keep max_model_len within it for exact results."""

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
    sliding_window: int | None = None

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads one rank holds: an even share, or one replicated head when tp > num_kv_heads."""
        return max(self.num_kv_heads // tp_size, 1)

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError unless the heads and MLP split evenly over `tp_size` ranks."""
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_heads} is not divisible by tp_size={tp_size}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} and tp_size={tp_size}: neither divides the other")
        if self.intermediate_size % tp_size:
            problems.append(f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp_size}")
        if problems:
            raise ValueError(f"cannot split {self.architecture} over {tp_size} ranks: " + "; ".join(problems))
