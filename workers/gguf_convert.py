"""llama.cpp's GGUF as a Hugging Face directory: the default model's one-time conversion (workers/default_model.py).
Its own module because what it needs (gguf, numpy, torch, transformers' LlamaConfig, whose import alone takes
~5 s of CPU here) is needed only while converting, not by every process that asks where the model is."""

from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaConfig

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write a Llama GGUF file as a Hugging Face directory: dequantized fp32 safetensors,
    config.json and the tokenizer (transformers converts GGUF tokenizers, chat template included)."""
    reader = gguf.GGUFReader(gguf_file)
    config = _llama_config(reader)
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"Converting {gguf_file.name}", unit="tensor"):
        name, weight = _hf_tensor(t, config)
        tensors[name] = torch.from_numpy(weight)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(out_dir)


def _field(reader: gguf.GGUFReader, key: str) -> int | float | str:
    value = reader.fields[key].contents()
    # GGUF stores floats as float32: print them back as the short decimals they came from.
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _llama_config(reader: gguf.GGUFReader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF file, got architecture {arch!r}")
    heads = _field(reader, "llama.attention.head_count")
    hidden = _field(reader, "llama.embedding_length")
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=_field(reader, "llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_field(reader, "llama.attention.head_count_kv"),
        head_dim=hidden // heads,
        max_position_embeddings=_field(reader, "llama.context_length"),
        rms_norm_eps=_field(reader, "llama.attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": _field(reader, "llama.rope.freq_base")},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        # llama.cpp writes no output.weight when the LM head is the embedding.
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        dtype="float32",
    )


def _hf_tensor(t: gguf.ReaderTensor, config: LlamaConfig) -> tuple[str, np.ndarray]:
    parts = t.name.split(".")
    if parts[0] == "blk":
        name = f"model.layers.{parts[1]}.{_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    else:
        name = f"{_TENSOR_NAMES[parts[0]]}.{parts[1]}"
    weight = gguf.quants.dequantize(t.data, t.tensor_type)
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        weight = unpermute_rope_rows(weight, heads)
    # F32 tensors come back as read-only views of the memory-mapped file; torch wants them writable.
    return name, np.require(weight, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which reorders each head's q/k rows from Hugging Face's
    half-split rotary layout (x1 | x2) to interleaved pairs (x1[0], x2[0], x1[1], ...)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
