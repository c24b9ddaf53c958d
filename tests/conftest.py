"""Shared fixtures: the converted default model, and tiny random-weight Hugging Face model
directories to compare our models against transformers' on."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# The session's Ray and the fixtures that serve on it, for every folder that starts an engine on Ray.
pytest_plugins = ["tests.ray_session"]


def pytest_configure(config: pytest.Config) -> None:
    """Everything outside tests/gpu is the CPU suite. On a GPU machine device="auto" would pick CUDA (and bf16,
    which breaks fp32 equality with transformers), tp=2 tests would wait for a second GPU, and module-scoped
    engines would take 90% of the GPU: hide the GPUs from a run that does not name tests/gpu (before anything
    initialises CUDA; Ray and its workers inherit it). tests/gpu runs on its own: `pytest tests/gpu`."""
    if not any("tests/gpu" in str(arg) for arg in config.args):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2-135M-Instruct converted from the bundled GGUF, once per test session (a fresh
    cache, so the conversion itself is exercised)."""
    from workers.default_model import default_model_path

    return default_model_path(str(tmp_path_factory.mktemp("raylm-cache")))


def _write_tiny_model(path: Path, model_type: str, overrides: dict[str, Any], max_shard_size: str | None) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY_CONFIG, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers initialises norms to 1 and biases to 0, and its weights are tiny: randomise
    # everything so that a misplaced norm, bias or head shows up in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model_dir(model_type, max_shard_size=None, **config_overrides)` -> the path of a
    Hugging Face directory holding a 2-layer random model of that type ("llama", "qwen2",
    "qwen3", "mistral", ...), written once per session per distinct request."""
    made: dict[str, str] = {}

    def make(model_type: str = "llama", max_shard_size: str | None = None, **overrides: Any) -> str:
        key = repr((model_type, max_shard_size, sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{model_type}")
            made[key] = _write_tiny_model(path, model_type, overrides, max_shard_size)
        return made[key]

    return make


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dir, tmp_path_factory):
    """(base model dir, adapter name -> path, prompts, {adapter or None: peft's greedy tokens per prompt}) for two
    random adapters of different ranks (tests/workers/adapters.py), made once per session."""
    from tests.workers.adapters import adapters_with_references

    base = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    return base, *adapters_with_references(base, tmp_path_factory.mktemp("lora"))
