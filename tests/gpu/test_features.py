"""The features whose GPU code the CPU suite reaches only through Triton's interpreter or not at all, run on CUDA
with the in-process executor: sliding windows and the mixture-of-experts families against transformers, the
batched LoRA op against peft, speculation (n-gram, a draft of the target itself) against no speculation, and
pooled embeddings against transformers."""

import pytest
import torch

from raylm import EngineRequest, SamplingParams
from tests.gpu.test_engine import cuda_engine, free, greedy, hf_greedy, run_and_free
from tests.workers.test_families import FAMILIES
from tests.workers.test_lora import run as run_with_adapters
from tests.workers.test_model_runner import prompts
from tests.workers.test_spec_decode import NGRAM, draft_config
from tests.workers.test_spec_decode import run as run_keyed


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_and_expert_families_match_transformers_in_fp32(tiny_model_dir, family):
    """Triton's windowed attention past the window (prompts of 5, 18 and 31 tokens, chunked), and the experts'
    Triton grouped matmul, against transformers on the same GPU; their decodes replay captured graphs."""
    model_type, overrides = FAMILIES[family]
    path = tiny_model_dir(model_type, None, **overrides)
    ids = prompts(3)
    expected = hf_greedy(path, ids, 12, torch.float32)
    engine = cuda_engine(path, dtype="float32", max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert engine.worker.runner.decode_graphs.graphs, "no decode graph was captured"
    assert run_and_free(engine, ids, greedy(3, 12)) == expected


def test_lora_adapters_mixed_with_the_base_match_peft(lora_adapters):
    """The Triton shrink/expand kernels with two adapters of different ranks and the base in one batch, decodes
    replaying graphs captured once for every mix of adapters."""
    base, paths, lora_prompts, expected = lora_adapters
    engine = cuda_engine(
        base,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[f"{n}={p}" for n, p in paths.items()],
    )
    mixed = [(name, p) for p in lora_prompts for name in (None, "attn8", "all4")]
    try:
        assert engine.worker.runner.decode_graphs.graphs, "no decode graph was captured"
        got = run_with_adapters(engine, mixed)
    finally:
        free(engine)
    assert got == [expected[n][lora_prompts.index(p)] for n, p in mixed]


def record_replays(graphs) -> list[tuple[int, int, bool]]:
    """Each replay's (size, tokens a request, whether a graph of that shape was captured), as it happens."""
    replayed, replay = [], graphs.replay

    def recorded(size: int, query_len: int = 1):
        replayed.append((size, query_len, (size, query_len) in graphs.graphs))
        return replay(size, query_len)

    graphs.replay = recorded
    return replayed


def test_speculation_gives_the_output_without_it(tiny_model_dir):
    """k + 1 rows verified per speculating request, by a captured graph of (1 + k)-token requests (the draft
    model's steps, where every request verifies k; n-gram's, whose counts differ, padded to it), the draft's
    catch-up and passes by its own graphs: greedy output equal to no speculation, and a draft that is the target
    has every proposal accepted."""
    path = tiny_model_dir("llama")
    rng = torch.Generator().manual_seed(6)
    ids = [[7, 8, 9, 10] * 3 + torch.randint(3, 256, (1 + 9 * i,), generator=rng).tolist() for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)] * 3
    common = {"dtype": "float32", "block_size": 16, "max_num_batched_tokens": 32}
    baseline = cuda_engine(path, **common)
    try:
        expected = run_keyed(baseline, ids, params)
    finally:
        free(baseline)
    for spec in (NGRAM, draft_config(path)):
        engine = cuda_engine(path, **common, speculative_config=spec)
        runner = engine.worker.runner
        replayed = record_replays(runner.decode_graphs)
        draft_replayed = record_replays(runner.draft.graphs) if runner.draft is not None else []
        try:
            got = run_keyed(engine, ids, params)
            stats = engine.stats()
        finally:
            free(engine)
        assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in expected.items()}, spec
        for key, entry in got.items():
            assert entry["logprobs"] == pytest.approx(expected[key]["logprobs"], abs=1e-4)
        assert stats.spec_decode_num_draft_tokens > 0, spec["method"]
        verify_len = 1 + spec["num_speculative_tokens"]
        assert any(q == verify_len and captured for _, q, captured in replayed), (spec["method"], replayed)
        if spec["method"] == "draft_model":
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
            # The draft's catch-up of those steps and its proposal passes replay its own graphs.
            assert {q for _, q, captured in draft_replayed if captured} == {1, 4}, draft_replayed


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_embeddings_match_transformers(tiny_model_dir, default_model_dir, pooling):
    """The pooling path on CUDA (eager: a pooling step is never a captured decode): the final hidden states, pooled
    over 16-token chunks of a 70-token prompt and normalised, against transformers' last hidden state on the GPU."""
    from transformers import AutoModel

    path = tiny_model_dir("llama")
    rng = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 9, 70)]
    engine = cuda_engine(
        path, tokenizer=default_model_dir, dtype="float32", max_num_batched_tokens=32, long_prefill_token_threshold=16
    )
    try:
        for i, prompt in enumerate(ids):
            engine.add_request(
                EngineRequest(
                    request_id=str(i),
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(max_tokens=1, pooling=pooling),
                )
            )
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        free(engine)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    for i, prompt in enumerate(ids):
        with torch.inference_mode():
            hidden = model(torch.tensor([prompt], device="cuda")).last_hidden_state[0].cpu()
        want = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
        out = outs[str(i)]
        assert out.finish_reason == "stop" and out.new_token_ids == []
        assert torch.tensor(out.embedding) == pytest.approx(want, abs=1e-4)
