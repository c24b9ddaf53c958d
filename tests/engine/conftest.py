"""For the RL rollout tests (test_rl.py in process, test_rl_ray.py at tp=2): a model changed as a trainer's step
would change it, and transformers' greedy tokens on the changed model, made once per session."""

from dataclasses import dataclass

import pytest
import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
NEW_TOKENS = 8
# Scaled in the first layers: a fused qkv shard, a fused gate_up shard and a row-parallel one, so that each of the
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


def change(model_dir: str) -> ChangedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(CHANGED) and int(name.split(".")[2]) < 4:  # a tiny model has 2 layers
                p.mul_(1.3)
                tensors.append((name, p.detach().clone()))
    greedy = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
            )
            greedy.append(y[0, len(ids) :].tolist())
    return ChangedModel(prompt_ids, tensors, greedy)
