"""What a model directory says beyond its weights, as the engine's settings select it: the tokenizer with the
chat template in force, the sampling defaults of its generation config, and how its embeddings are pooled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, chat_template_text

# generation_config.json's sampling fields (SamplingParams names them alike): the defaults --generation-config auto
# applies to a request that leaves them unset, as vLLM does. max_new_tokens is not one: a request's length is the
# room its context leaves unless it asks for less.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_tokenizer(config: EngineConfig, model_path: str):
    """The tokenizer every prompt is encoded with, carrying the chat template `config` names (if any)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.resolved_tokenizer(model_path))
    if config.chat_template is not None:
        tokenizer.chat_template = chat_template_text(config.chat_template)
    return tokenizer


def generation_defaults(config: EngineConfig, model_path: str) -> dict[str, Any]:
    """SamplingParams fields a request falls back to when it leaves them unset: those in the generation config
    `config.generation_config` names ("auto": the model's own; "vllm": none)."""
    if config.generation_config == "vllm":
        return {}
    root = Path(model_path if config.generation_config == "auto" else config.generation_config)
    path = root / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {name: data[name] for name in GENERATION_DEFAULTS if data.get(name) is not None}


def serves_embeddings(runner: str, model_path: str) -> bool:
    """Whether /v1/embeddings is served: ``runner="pooling"``, or for "auto" a sentence-transformers export (an
    embedding model such as Qwen3-Embedding ships its pooling with it; a chat model's hidden states are no
    embedding anyone trained for)."""
    if runner != "auto":
        return runner == "pooling"
    return (Path(model_path) / "modules.json").is_file() or (Path(model_path) / "1_Pooling").is_dir()


def not_an_embedding_model(model: str) -> str:
    """Why a model served for generation refuses embeddings, and how to have them anyway."""
    return (
        f"{model} is served for generation (runner=generate): it is no embedding model, and its hidden states are "
        f"no embedding it was trained for. Serve an embedding model (a sentence-transformers export), or start with "
        f"--runner pooling to embed with this one anyway"
    )


def pooling_type(setting: str, model_path: str) -> str:
    """How /v1/embeddings pools ("last" or "mean"): the setting, or for "auto" what a sentence-transformers
    model's 1_Pooling/config.json says (Qwen3-Embedding: last token; most encoders' exports: mean), else
    the last token, which is what a decoder has read the whole input by."""
    if setting != "auto":
        return setting
    path = Path(model_path) / "1_Pooling" / "config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    return "mean" if data.get("pooling_mode_mean_tokens") and not data.get("pooling_mode_lasttoken") else "last"
