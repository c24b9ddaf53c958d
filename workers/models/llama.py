"""The Llama family: Llama 2/3, SmolLM2, Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (per-head
q/k RMSNorm), and the mixture-of-experts Qwen3-MoE and Mixtral (`models/moe.py` in place of the MLP),
one definition whose variants are fields of `ModelSpec`.

Module and parameter names follow Hugging Face's, except that q/k/v and gate/up are fused per
rank (`packed_modules` tells the loader which checkpoint tensors feed which fused weight).
"""

import torch
from torch import nn

from kernels import AttentionBackend, AttentionMetadata
from kernels.fused import silu_and_mul
from workers.layers import (
    Attention,
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_shards,
    qkv_shards,
)
from workers.model_spec import ModelSpec
from workers.models.moe import SparseMoeBlock
from workers.parallel import MissingLayer, pipeline_stage, stage_modules


class LlamaAttention(nn.Module):
    """Self-attention over this rank's `num_heads / tp` query heads and the KV heads they need."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, rank: int, tp_size: int, window: int | None):
        super().__init__()
        d = spec.head_dim
        self.num_heads = spec.num_heads // tp_size
        self.num_kv_heads = spec.kv_heads_per_rank(tp_size)
        shards = qkv_shards(spec.num_heads, spec.num_kv_heads, d, rank, tp_size)
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, shards, spec.qkv_bias)
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, spec.o_bias, rank, tp_size)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, backend, window)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        t, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.attn.head_dim
        qk, v = self.qkv_proj(x).split([(h + kv) * d, kv * d], dim=-1)
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = self.attn(qk.view(t, h + kv, d), v.view(t, kv, d), cos, sin, attn_metadata, qk_norm)
        return self.o_proj(out.view(t, h * d))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), intermediate units split over ranks."""

    def __init__(self, spec: ModelSpec, rank: int, tp_size: int):
        super().__init__()
        shards = even_shards(("gate_proj", "up_proj"), spec.intermediate_size, rank, tp_size)
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, shards, spec.mlp_bias)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, spec.mlp_bias, rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. The residual stream is carried separately and added inside the next norm,
    so a layer returns (output, residual) rather than their sum. Layer `index` reads its own sliding
    window and whether it has experts from the spec."""

    def __init__(
        self, spec: ModelSpec, backend: AttentionBackend, rank: int, tp_size: int, index: int, expert_parallel: bool
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, backend, rank, tp_size, spec.window(index))
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.moe is not None and index in spec.moe.sparse_layers:
            self.mlp = SparseMoeBlock(spec, rank, tp_size, expert_parallel)
        else:
            self.mlp = LlamaMLP(spec, rank, tp_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, cos, sin, attn_metadata)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; one rotary table shared by every layer. A pipeline stage
    (workers/parallel.py) holds its own layers, the first the embedding (the last too when the LM head is
    tied to it), and returns (hidden, residual) to the next stage unless it is the last."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, rank: int, tp_size: int, expert_parallel: bool):
        super().__init__()
        self.stage = stage = pipeline_stage()
        embeds = stage.is_first or (stage.is_last and spec.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, rank, tp_size) if embeds else MissingLayer()
        )
        self.layers = stage_modules(
            spec.num_layers, lambda i: LlamaDecoderLayer(spec, backend, rank, tp_size, i, expert_parallel)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        cos, sin = self.rotary_emb(positions)
        for layer in self.layers[self.stage.start : self.stage.end]:
            x, residual = layer(x, residual, cos, sin, attn_metadata)
        if not self.stage.is_last:
            return x, residual
        return self.norm.add_and_norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The model a worker runs: `forward` maps the flattened tokens of every request in a step to
    hidden states; `compute_logits` turns the rows worth sampling into full-vocabulary logits on
    rank 0. With tied embeddings the LM head is the embedding module itself (one weight). With
    `expert_parallel` each rank holds whole experts rather than a slice of every one."""

    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        rank: int = 0,
        tp_size: int = 1,
        expert_parallel: bool = False,
    ):
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec, backend, rank, tp_size, expert_parallel)
        if spec.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        elif self.model.stage.is_last:
            self.lm_head = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, rank, tp_size)
        else:
            self.lm_head = MissingLayer()

    @property
    def attention_layers(self) -> list[Attention]:
        stage = self.model.stage
        return [layer.self_attn.attn for layer in self.model.layers[stage.start : stage.end]]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage's hidden states, or (hidden, residual) for the next stage; ``intermediate`` is the
        previous stage's, None on the first."""
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.logits(hidden)
