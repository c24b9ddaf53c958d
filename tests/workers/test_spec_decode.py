"""Speculative decoding on the ranks: greedy output identical with and without proposals (the tiny model, in
process), and rejection sampling that keeps the target's distribution exactly (a chi-square bound)."""

import dataclasses

import pytest
import torch

from engine.inprocess import InProcessEngine
from raylm import EngineConfig, SamplingParams
from scheduler import EngineRequest, StructuredOutputsParams
from tests.workers.test_models import TINY_MODELS
from workers.sampler import LogprobRows, Sampler, SamplingMetadata, verified_logprobs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def run(engine: InProcessEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=sp))
    got: dict = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            entry = got.setdefault((o.request_id, o.index), {"tokens": [], "logprobs": [], "reason": None})
            entry["tokens"] += o.new_token_ids
            entry["logprobs"] += [e.logprob for e in o.new_logprobs or ()]
            entry["reason"] = o.finish_reason
    return got


def assert_opted_out_requests_get_no_proposals(engine: InProcessEngine, prompts, params, expected: dict) -> None:
    """Requests with disable_spec_decode on the speculating ``engine``: no proposal made, the same output."""
    before = engine.stats().spec_decode_num_drafts
    opted_out = [dataclasses.replace(p, disable_spec_decode=True) for p in params]
    got = run(engine, prompts, opted_out)
    assert {k: v["tokens"] for k, v in got.items()} == {k: expected[k]["tokens"] for k in got}
    assert engine.stats().spec_decode_num_drafts == before


def test_greedy_output_is_the_same_with_and_without_proposals(tiny_model_dir):
    path = tiny_model_dir("llama")
    rng = torch.Generator().manual_seed(3)
    # Repeated text, so that prompt lookup finds matches; some prompts span several blocks (chunked below).
    prompts = [
        ([7, 8, 9, 10, 11] * (2 + i)) + torch.randint(3, 256, (3 + 4 * i,), generator=rng).tolist() for i in range(4)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens inside a run
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[9]),
        # Seeded sampling gets no proposals, so its tokens are the same; penalties neither (they change along a run).
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=20, ignore_eos=True),
    ]
    prompts += prompts[:2]
    common = {"model": path, "device": "cpu", "block_size": 8, "max_num_batched_tokens": 24, "kv_cache_bytes": 1 << 20}
    expected = run(InProcessEngine(EngineConfig(**common)), prompts, params)
    engine = InProcessEngine(EngineConfig(**common, speculative_config=NGRAM))
    got = run(engine, prompts, params)
    assert {k: (v["tokens"], v["reason"]) for k, v in got.items()} == {
        k: (v["tokens"], v["reason"]) for k, v in expected.items()
    }
    for key, entry in got.items():  # the target's logprobs, accepted tokens' included
        assert entry["logprobs"] == pytest.approx(expected[key]["logprobs"], abs=1e-4)
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    assert engine.scheduler.kv.block_pool.num_free_blocks == engine.num_blocks - 1
    assert_opted_out_requests_get_no_proposals(engine, prompts[:2], params[:2], expected)
    # Unseeded sampling with every position-independent feature verifies by rejection sampling: it runs to length.
    sampled = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, logit_bias={7: 5.0}, max_tokens=25, ignore_eos=True, n=2
    )
    before = engine.stats().spec_decode_num_drafts
    out = run(engine, prompts[:2], [sampled] * 2)
    assert sorted(len(v["tokens"]) for v in out.values()) == [25] * 4
    assert engine.stats().spec_decode_num_drafts > before


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probs, over the tokens probs allows; and its degrees of
    freedom. A token probs forbids must never be drawn."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the processed distribution forbids was drawn"
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


# Upper 1e-4 quantiles of chi-square by degrees of freedom: a correct sampler fails once in 10,000 runs.
CHI2_CRITICAL = {2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


def test_rejection_sampling_keeps_the_target_distribution():
    """Two proposals per request, verified against three processed distributions (temperature and top-k on
    a 6-token vocabulary). The first token must follow p0 whether its proposal was accepted or resampled; the
    second, given the first was the accepted proposal, p1; the third, given both were, p2. Resampling from p0 itself instead of the residual
    (p0 without the rejected proposal) would put p0(t) + (1 - p0(t)) p0(t) on the proposal: far off."""
    torch.manual_seed(0)
    num_requests, vocab = 20000, 6
    rows = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, 0.0], [0.1, 0.3, 2.5, 0.0, 1.0, -2.0], [1.0] * 6])
    drafts = [1, 2]
    params = SamplingParams(temperature=0.8, top_k=4)
    logits = rows.repeat(num_requests, 1)
    md = SamplingMetadata.build(
        [params] * 3 * num_requests, [None] * 3 * num_requests, [0] * 3 * num_requests, None, vocab, "cpu"
    )
    target = (
        Sampler()
        .process_logits(rows.clone(), SamplingMetadata.build([params] * 3, [None] * 3, [0] * 3, None, vocab, "cpu"))
        .softmax(-1)
    )
    draft_ids = torch.tensor(drafts + [-1]).repeat(num_requests)
    out, _ = Sampler().verify(logits, md, draft_ids, [2] * num_requests)
    token, accepted = out[:, 0], out[:, 1]
    first = torch.where(accepted >= 1, drafts[0], token)
    second = torch.where(accepted >= 2, drafts[1], token)[accepted >= 1]
    third = token[accepted == 2]  # sampled from the last row, after both proposals were accepted
    for observed, probs in ((first, target[0]), (second, target[1]), (third, target[2])):
        stat, dof = chi_square(torch.bincount(observed, minlength=vocab).float(), probs)
        assert stat < CHI2_CRITICAL[dof], (stat, dof)


def test_verification_logprobs_are_the_plain_samplers_rows_split_per_request_once_read_back():
    """Verification returns its logprobs in the plain sampler's shape (LogprobRows, read back at finish): a row
    per logits row with its proposal's entry, or its sampled token's on the row that samples; per request, the
    accepted proposals' rows and the sampled token's row, dropping rows past it."""
    torch.manual_seed(3)
    vocab = 8
    logits = torch.randn(4, vocab)
    raw = logits.log_softmax(-1)
    greedy = logits.argmax(-1)
    # Request 0: two proposals, the first the argmax (accepted), the second not (rejected); request 1: none, and
    # asks for no logprobs (its entry is None).
    draft_ids = torch.tensor([greedy[0].item(), (greedy[1].item() + 1) % vocab, -1, -1])
    num_drafts = [2, 0]
    rows_of = [0, 0, 0, 1]
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)]
    md = SamplingMetadata.build([params[r] for r in rows_of], [None] * 4, [0] * 4, None, vocab, "cpu")
    out, rows = Sampler().verify(logits.clone(), md, draft_ids, num_drafts)
    assert out.tolist() == [[greedy[1].item(), 1], [greedy[3].item(), 0]]
    assert isinstance(rows, LogprobRows)
    token_ids, num_accepted = out[:, 0].tolist(), out[:, 1].tolist()
    sampled, accepted = verified_logprobs(rows.to_list(), num_drafts, num_accepted)
    assert [e.logprob for e in accepted[0]] == pytest.approx([raw[0, draft_ids[0]].item()], abs=1e-6)
    assert accepted[1] == [] and sampled[1] is None
    assert sampled[0].logprob == pytest.approx(raw[1, token_ids[0]].item(), abs=1e-6)
    assert sampled[0].top_token_ids == raw[1].topk(2).indices.tolist()


def draft_config(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def test_a_draft_that_is_the_target_has_every_proposal_accepted(tiny_model_dir):
    """The strong check of the bookkeeping: the draft's KV follows the target's through chunked prefill, prefix
    hits, rollbacks and preemption by swap (its blocks go to the host tier and back with the target's), so the
    draft = the target proposes exactly the target's greedy tokens, all accepted; the output is the one without
    speculation for n=2, stop ids and max_tokens inside an accepted run."""
    path = tiny_model_dir("llama")
    rng = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 256, (20,), generator=rng).tolist()  # a prefix-cache hit for the later prompts
    prompts = [shared + torch.randint(3, 256, (2 + 5 * i,), generator=rng).tolist() for i in range(4)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),  # ends inside a run of 4
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=list(range(3, 256, 9))),
    ]
    common = {"model": path, "device": "cpu", "block_size": 8, "max_num_batched_tokens": 24, "kv_cache_bytes": 1 << 20}
    expected = run(InProcessEngine(EngineConfig(**common)), prompts, params)
    # 16 blocks of 8 tokens for the target's and the draft's KV: the 5 sequences preempt each other
    swap = {"kv_cache_bytes": 16 * 8192, "swap_space": 1 / 1024, "preemption_mode": "swap"}
    engine = InProcessEngine(EngineConfig(**{**common, **swap}, speculative_config=draft_config(path)))
    got = run(engine, prompts, params)
    assert {k: (v["tokens"], v["reason"]) for k, v in got.items()} == {
        k: (v["tokens"], v["reason"]) for k, v in expected.items()
    }
    assert engine.num_blocks == 16 and engine.stats().num_blocks_swapped_in > 0
    assert expected[("3", 0)]["reason"] == "stop" and len(expected[("3", 0)]["tokens"]) % 4 != 1
    for key, entry in got.items():
        assert entry["logprobs"] == pytest.approx(expected[key]["logprobs"], abs=1e-4)
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert engine.scheduler.kv.block_pool.num_free_blocks == engine.num_blocks - 1
    assert_opted_out_requests_get_no_proposals(engine, prompts[:2], params[:2], expected)


def test_constrained_requests_beside_speculating_ones_give_the_output_without_speculation(
    tiny_model_dir, default_model_dir
):
    """A JSON-schema constraint (no proposals: the mask moves along a run) in steps whose other requests
    verify n-gram or draft proposals: every request's greedy output is the one without speculation."""
    path = tiny_model_dir("llama", vocab_size=49152)  # the default model's tokenizer, for the grammars
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    prompts = [[7, 8, 9, 10] * 4, [5, 6, 7] * 5, [7, 8, 9, 10] * 2 + [11, 12]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=schema)),
    ]
    # Biased to the prompts' tokens, so that the unconstrained requests' output repeats them and n-gram proposes.
    bias = dict.fromkeys(range(5, 11), 5)
    params += [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=bias)] * 2
    common = {"model": path, "tokenizer": default_model_dir, "device": "cpu", "block_size": 8}
    expected = run(InProcessEngine(EngineConfig(**common)), prompts, params)
    for spec in (NGRAM, draft_config(path)):
        engine = InProcessEngine(EngineConfig(**common, speculative_config=spec))
        assert run(engine, prompts, params) == expected, spec["method"]
        assert engine.stats().spec_decode_num_accepted_tokens > 0, spec["method"]


# The other families, one of each kind: tied embeddings, windows shorter than a verified run (on every layer, and
# on one layer of two), experts. Llama's is the tests above.
FAMILIES = ["qwen2 (qkv bias, tied)", "mistral (sliding window 4)", "qwen3 (sliding window 3 on layer 1)", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gives_the_same_greedy_output_with_ngram_and_a_draft_of_itself(tiny_model_dir, family):
    """Per family, greedy output with n-gram proposals and with the model as its own draft (which must have every
    proposal accepted) is the output without speculation, token for token, through chunked prefill."""
    model_type, shard, overrides = TINY_MODELS[family]
    path = tiny_model_dir(model_type, shard, **overrides)
    rng = torch.Generator().manual_seed(6)
    prompts = [[7, 8, 9, 10] * 3 + torch.randint(3, 256, (1 + 9 * i,), generator=rng).tolist() for i in range(2)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 2
    common = {"model": path, "device": "cpu", "block_size": 8, "max_num_batched_tokens": 16, "kv_cache_bytes": 1 << 20}
    expected = run(InProcessEngine(EngineConfig(**common)), prompts, params)
    for spec in (NGRAM, draft_config(path)):
        engine = InProcessEngine(EngineConfig(**common, speculative_config=spec))
        assert run(engine, prompts, params) == expected, spec["method"]
        stats = engine.stats()
        assert stats.spec_decode_num_draft_tokens > 0, spec["method"]  # n-gram's are seldom accepted: random weights
        if spec["method"] == "draft_model":
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_a_smaller_draft_gives_the_output_of_no_speculation(tiny_model_dir):
    """Another, smaller draft with the target's vocabulary (the target with one layer): whatever it proposes, the
    output is the target's, under preemption by recompute too."""
    path = tiny_model_dir("llama")
    draft = tiny_model_dir("llama", num_hidden_layers=1)
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (4 + 9 * i,), generator=rng).tolist() for i in range(2)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2),
    ]
    common = {"model": path, "device": "cpu", "block_size": 8}
    expected = run(InProcessEngine(EngineConfig(**common, kv_cache_bytes=1 << 20)), prompts, params)
    # 6 blocks of the two models' KV (6 KiB each): the 3 sequences preempt each other, recomputed
    engine = InProcessEngine(EngineConfig(**common, kv_cache_bytes=6 * 6144, speculative_config=draft_config(draft, 2)))
    assert run(engine, prompts, params) == expected
    stats = engine.stats()
    assert engine.num_blocks == 6 and stats.spec_decode_num_draft_tokens > 0 and stats.num_preemptions > 0


@pytest.mark.parametrize(
    ("draft_overrides", "message"),
    [({"vocab_size": 300}, "vocab_size=300"), ({"hidden_size": 128, "intermediate_size": 256}, "more than the target")],
)
def test_a_draft_that_cannot_serve_is_refused_at_start(tiny_model_dir, draft_overrides, message):
    target = tiny_model_dir("llama")
    draft = tiny_model_dir("llama", **draft_overrides)
    with pytest.raises(ValueError, match=message) as err:
        InProcessEngine(EngineConfig(model=target, device="cpu", speculative_config=draft_config(draft)))
    assert "speculative_config model=" in str(err.value)
