"""Random LoRA adapters of a tiny model in PEFT's format, and transformers + peft's greedy tokens under them."""

from pathlib import Path

import torch

NEW_TOKENS = 12
# Two adapters of different ranks and targets; the second scales by alpha / sqrt(r) (rsLoRA).
ADAPTERS = {
    "attn8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all4": dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    ),
}


def make_adapter(base_dir: str, out: Path, seed: int, **lora) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora))
    with torch.no_grad():  # peft starts B at zero (no effect): random A and B make each adapter's tokens its own
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return str(out)


def peft_greedy(base_dir: str, adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def adapters_with_references(base: str, root: Path) -> tuple[dict[str, str], list[list[int]], dict]:
    """The ADAPTERS of `base` written under `root`, three prompts, and peft's greedy tokens of each prompt under
    each adapter and the base model (None)."""
    paths = {name: make_adapter(base, root / name, seed, **cfg) for seed, (name, cfg) in enumerate(ADAPTERS.items())}
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + 9 * i)] for i in range(3)]
    expected = {name: peft_greedy(base, paths.get(name), prompts) for name in (None, *paths)}
    return paths, prompts, expected
