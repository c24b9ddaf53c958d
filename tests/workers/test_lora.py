"""LoRA adapters against transformers + peft, token for token: one adapter alone, two adapters and the base model
mixed in one batch, more adapters in flight than resident slots, and each bad adapter refused by name."""

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.inprocess import InProcessEngine
from scheduler import EngineRequest, SamplingParams
from tests.workers.adapters import NEW_TOKENS


def lora_engine(base: str, paths: dict[str, str], max_loras: int) -> InProcessEngine:
    return InProcessEngine(
        EngineConfig(
            model=base,
            device="cpu",
            enable_lora=True,
            max_loras=max_loras,
            max_lora_rank=8,
            lora_modules=[f"{n}={p}" for n, p in paths.items()],
            kv_cache_bytes=8 << 20,
        )
    )


def run(engine: InProcessEngine, runs: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """Greedy tokens of each (adapter, prompt), all submitted at once."""
    ids = [f"r{next(COUNTER)}" for _ in runs]
    for rid, (name, prompt) in zip(ids, runs):
        engine.add_request(
            EngineRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                lora_name=name,
            )
        )
    got = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[rid] for rid in ids]


COUNTER = itertools.count()


@pytest.fixture(scope="module")
def two_slots(lora_adapters):
    base, paths, _, _ = lora_adapters
    return lora_engine(base, paths, max_loras=2)


def test_adapters_alone_and_mixed_with_the_base_match_peft(lora_adapters, two_slots):
    _, _, prompts, expected = lora_adapters
    assert expected["attn8"] != expected[None] != expected["all4"]  # each adapter changes the tokens
    assert run(two_slots, [("attn8", p) for p in prompts]) == expected["attn8"]
    # Every prompt under every adapter and the base, all in one batch.
    mixed = [(name, p) for p in prompts for name in (None, "attn8", "all4")]
    assert run(two_slots, mixed) == [expected[name][prompts.index(p)] for name, p in mixed]


def test_prefix_cache_is_not_shared_across_adapters(lora_adapters, two_slots):
    _, _, prompts, expected = lora_adapters
    long_prompt = [t + 1 for t in prompts[2]]  # two full blocks of 16, a prompt no other test sent
    run(two_slots, [("attn8", long_prompt)])
    before = two_slots.stats().prefix_cache_hits
    run(two_slots, [("all4", long_prompt), (None, long_prompt)])
    assert two_slots.stats().prefix_cache_hits == before  # equal text, another adapter or the base: no hit
    run(two_slots, [("all4", long_prompt)])
    assert two_slots.stats().prefix_cache_hits > before  # the same adapter: a hit


def test_more_adapters_than_slots_all_finish_and_load_at_run_time(lora_adapters):
    """One slot, two adapters in flight: a request of the adapter not resident waits for the slot. An adapter
    loaded at run time serves at once; unloading refuses an absent name."""
    base, paths, prompts, expected = lora_adapters
    engine = lora_engine(base, {"all4": paths["all4"]}, max_loras=1)
    with pytest.raises(ValueError, match="'attn8'"):
        run(engine, [("attn8", prompts[0])])
    engine.add_lora("attn8", paths["attn8"])
    with pytest.raises(ValueError, match="'attn8'.*already loaded"):
        engine.add_lora("attn8", paths["attn8"])
    mixed = [(n, prompts[i % len(prompts)]) for i, n in enumerate(["attn8", "all4", None, "all4", "attn8"])]
    assert run(engine, mixed) == [expected[n][prompts.index(p)] for n, p in mixed]
    engine.add_request(
        EngineRequest(
            request_id="busy",
            prompt_token_ids=prompts[0],
            sampling_params=SamplingParams(max_tokens=4),
            lora_name="attn8",
        )
    )
    with pytest.raises(ValueError, match="'attn8'.*running"):
        engine.remove_lora("attn8")
    engine.abort("busy")
    engine.remove_lora("attn8")
    with pytest.raises(ValueError, match="'attn8'.*no adapter"):
        engine.remove_lora("attn8")


def _edited(src: str, dst: Path, config=None, tensors=None) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    if tensors is not None:
        path = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(path)), path)
    return str(dst)


def test_bad_adapters_are_refused_by_name(lora_adapters, tiny_model_dir, tmp_path):
    from workers.lora import read_adapter
    from workers.model_loader import read_model_spec

    base, paths, _, _ = lora_adapters
    spec = read_model_spec(base)
    src = paths["attn8"]

    def refused(path: str, match: str, max_rank: int = 8) -> None:
        with pytest.raises(ValueError, match=match):
            read_adapter("bad", path, spec, max_rank)

    refused(str(tmp_path / "nowhere"), "'bad'.*does not exist")
    refused(src, "'bad'.*rank 8 is above max_lora_rank=4", max_rank=4)
    other = tiny_model_dir("llama", hidden_size=32)
    refused(_edited(src, tmp_path / "arch", config=lambda c: {**c, "base_model_name_or_path": other}), "hidden_size")
    wide = tiny_model_dir("llama", vocab_size=300)
    refused(_edited(src, tmp_path / "vocab", config=lambda c: {**c, "base_model_name_or_path": wide}), "vocab_size")

    def with_head(t):  # an adapter of the LM head, trained on a vocabulary of 300
        return {**t, "base_model.model.lm_head.lora_B.weight": torch.zeros(300, 8)}

    refused(_edited(src, tmp_path / "head", tensors=with_head), "'bad'.*vocabulary of 300, the model's is 256")

    def renamed(t):
        return {k.replace("q_proj", "qq_proj"): v for k, v in t.items()}

    refused(_edited(src, tmp_path / "target", tensors=renamed), "'bad'.*self_attn.qq_proj.*does not have")

    def shrunk(t):  # trained on a model of another hidden size, with no base path to tell
        return {k: v[:, :32].contiguous() if "lora_A" in k else v for k, v in t.items()}

    no_base = _edited(src, tmp_path / "hidden", config=lambda c: {**c, "base_model_name_or_path": None}, tensors=shrunk)
    refused(no_base, "'bad'.*hidden size 64")
    with pytest.raises(ValueError, match="'bad'.*does not exist"):
        lora_engine(base, {"bad": str(tmp_path / "nowhere")}, max_loras=1)
