"""Greedy generation of the newer families through the engine (scheduler, paged KV, chunked prefill, native
decode) against transformers' generate, token for token: Mistral with a window shorter than its prompts, and
the mixture-of-experts families."""

import pytest
import torch

from raylm import SamplingParams
from tests.workers.test_model_runner import engine, prompts, run
from tests.workers.test_models import MIXTRAL, QWEN3_MOE

FAMILIES = {
    "mistral (window 12)": ("mistral", dict(sliding_window=12)),
    "qwen3_moe": ("qwen3_moe", QWEN3_MOE),
    "mixtral": ("mixtral", MIXTRAL),
}


def transformers_greedy(path: str, ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in ids:
            x = torch.tensor([p])
            generated = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(generated[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_model_dir, family):
    model_type, overrides = FAMILIES[family]
    path = tiny_model_dir(model_type, None, **overrides)
    ids = prompts(3)  # 5, 18 and 31 tokens: two prompts already longer than Mistral's window
    # A 16-token step budget: the long prompts prefill in chunks, beside the others' decodes.
    eng = engine(path, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    got = run(eng, ids, [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 3)
    assert got == transformers_greedy(path, ids, 10)
