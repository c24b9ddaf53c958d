"""For the RL rollout tests (test_rl.py in process, test_rl_ray.py at tp=2): a model changed by a trainer's step,
and transformers' greedy tokens on the changed model, made once per session."""

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
NEW_TOKENS = 8
# Stepped in the first layers: a fused qkv shard, a fused gate_up shard and a row-parallel one, so that each of the
# loaders' ways to take a shard is exercised.
CHANGED = ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight")


@dataclass(slots=True)
class ChangedModel:
    """``tensors``: the changed parameters, by Hugging Face name, full; ``greedy``: transformers' tokens on the
    changed model for ``prompt_ids``, ``NEW_TOKENS`` each, EOS ignored."""

    prompt_ids: list[list[int]]
    tensors: list[tuple[str, torch.Tensor]]
    greedy: list[list[int]]


@pytest.fixture(scope="session")
def changed_model(default_model_dir) -> ChangedModel:
    """The default model, changed (tp=1: its 9 heads split over no other rank count)."""
    return change(default_model_dir)


@pytest.fixture(scope="session")
def changed_tiny_model(servable_tiny_model) -> tuple[str, ChangedModel]:
    """A tiny random Llama that splits over 2 ranks (with the default model's tokenizer), and it changed."""
    model_dir = servable_tiny_model("llama")
    return model_dir, change(model_dir)


def _first_layers(name: str) -> bool:
    return name.endswith(CHANGED) and int(name.split(".")[2]) < 4  # a tiny model has 2 layers


def _tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out |= load_file(file)
    return out


def _checkpoint_tensors(model, model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors the step changed, by the checkpoint's names, as the trainer would write them: transformers keeps
    a MoE's experts fused in memory (mlp.experts.gate_up_proj) and writes each expert's own tensors."""
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        saved = _tensors(out)
    original = _tensors(model_dir)
    return [(n, t) for n, t in sorted(saved.items()) if n in original and not torch.equal(t, original[n])]


def change(model_dir: str, changed: Callable[[str], bool] = _first_layers, lr: float = 1e-2) -> ChangedModel:
    """One AdamW step in transformers on the language-modelling loss of PROMPTS, taken by the parameters ``changed``
    names (each moves by about ``lr``: Adam's first step is the gradient's sign), as a trainer's step changes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stepped = [(name, p) for name, p in model.named_parameters() if changed(name)]
    for name, p in model.named_parameters():
        p.requires_grad_(changed(name))
    optimizer = torch.optim.AdamW([p for _, p in stepped], lr=lr, weight_decay=0.0)
    model.train()
    for ids in prompt_ids:
        x = torch.tensor([ids])
        model(x, labels=x).loss.backward()
    optimizer.step()
    model.eval()
    tensors = _checkpoint_tensors(model, model_dir)
    greedy = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
            )
            greedy.append(y[0, len(ids) :].tolist())
    return ChangedModel(prompt_ids, tensors, greedy)
