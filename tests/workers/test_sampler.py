"""Sampler tests against direct per-row references on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from scheduler.outputs import SampledLogprobs
from scheduler.sampling_params import SamplingParams
from workers.sampler import PenaltyState, Sampler, SamplingMetadata, argmax

V = 10
# Distinct values, and top-p / min-p cut-offs used below sit far from any boundary.
LOGITS = torch.tensor([2.0, 1.5, 1.1, 0.6, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0])
NEG_INF = float("-inf")


def penalty_state(prompts, outputs, vocab=V):
    """A PenaltyState whose row i holds prompts[i], then outputs[i] counted one step at a time."""
    state = PenaltyState(vocab, "cpu")
    for row, prompt in enumerate(prompts):
        state.start(row, prompt, len(prompts))
    for step in range(max(map(len, outputs), default=0)):
        rows = [r for r, out in enumerate(outputs) if step < len(out)]
        state.count(torch.tensor(rows), torch.tensor([outputs[r][step] for r in rows]))
    return state


def build(params, *, prompts=None, outputs=None, generators=None, eos=None, vocab=V):
    n = len(params)
    outputs = outputs or [[]] * n
    penalties = penalty_state(prompts or [[0]] * n, outputs, vocab).penalties(params, torch.arange(n))
    return SamplingMetadata.build(
        params, generators or [None] * n, [len(o) for o in outputs], eos, vocab, "cpu", penalties
    )


def processed_probs(logits, params, **kw):
    return torch.softmax(Sampler().process_logits(logits.clone(), build(params, **kw)), -1)


def renorm(probs, keep):
    total = sum(probs[t] for t in keep)
    return [probs[t] / total if t in keep else 0.0 for t in range(len(probs))]


def ref_probs(row, temperature=1.0, min_p=0.0, top_k=-1, top_p=1.0):
    """vLLM order: temperature, min-p, top-k, then top-p on what top-k left."""
    probs = torch.softmax(row.double() / temperature, -1).tolist()
    probs = renorm(probs, {t for t, p in enumerate(probs) if p >= min_p * max(probs)})
    ranked = sorted(range(len(probs)), key=lambda t: -probs[t])
    if top_k != -1:
        probs = renorm(probs, set(ranked[:top_k]))
    keep, mass = set(), 0.0
    for t in ranked:  # smallest most-likely-first set whose mass reaches top_p
        if mass >= top_p:
            break
        keep.add(t)
        mass += probs[t]
    return renorm(probs, keep)


def sample_many(row, params, n):
    """n independent draws of one request: n identical rows sampled in one batched call."""
    sampled, _ = Sampler()(row.repeat(n, 1), build([params] * n, vocab=row.numel()))
    return torch.bincount(sampled, minlength=row.numel()).double() / n


def test_all_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, temperature=0.5),
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(top_k=1),
    ]
    metadata = build(params)
    sampled, logprobs = Sampler()(logits.clone(), metadata)
    assert metadata.all_greedy and logprobs is None
    assert sampled.tolist() == logits.argmax(-1).tolist()


def test_argmax_picks_as_torch_argmax_does_on_ties_nan_and_masked_rows():
    x = torch.randn(5, 49152)
    x[0, 7] = x[0, 40000] = 100.0  # a tie: the first
    x[1, 3], x[1, 30000] = 100.0, float("nan")  # NaN counts as the largest
    x[2] = float("-inf")  # every token masked
    x[3, -1] = 100.0
    assert argmax(x).tolist() == x.argmax(-1).tolist() == [7, 30000, 0, 49151, int(x[4].argmax())]


def test_tiny_temperatures_take_the_greedy_path():
    # As fp32, 1e-40 is subnormal and 1e-50 is 0: dividing these logits by either overflows to inf and NaN.
    logits = LOGITS.flip(0).repeat(3, 1)  # the argmax is the last token, not the first positive one
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-50), SamplingParams(temperature=1.0)]
    metadata = build(params)
    assert metadata.greedy.tolist() == [True, True, False]
    for _ in range(5):
        sampled, _ = Sampler()(logits.clone(), metadata)
        assert sampled[:2].tolist() == [V - 1, V - 1]
    sampled, _ = Sampler()(logits[:2].clone(), build(params[:2]))
    assert sampled.tolist() == [V - 1, V - 1]


def test_greedy_rows_mixed_with_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 0.3  # flat enough that random rows rarely hit their argmax
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.5),
    ]
    seen = [set() for _ in params]
    for _ in range(30):
        sampled, _ = Sampler()(logits.clone(), build(params))
        for i, t in enumerate(sampled.tolist()):
            seen[i].add(t)
    argmax = logits.argmax(-1).tolist()
    assert seen[0] == {argmax[0]} and seen[2] == {argmax[2]}
    assert len(seen[1]) > 1 and len(seen[3]) > 1


@pytest.mark.parametrize("with_top_p", [False, True], ids=["topk-only", "with-top-p-row"])
def test_top_k_keeps_k_most_likely_per_row(with_top_p):
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.roll(3), LOGITS])
    ks = [3, -1, 5, 2]  # the top-k-off row sits beside rows whose k is small
    params = [SamplingParams(top_k=k) for k in ks]
    if with_top_p:  # a top-p row in the batch: every row also takes the top-p cut, at top_p 1 for these
        rows = torch.cat([rows, LOGITS[None]])
        params.append(SamplingParams(top_p=0.7))
    probs = processed_probs(rows, params)
    for i, k in enumerate(ks):
        assert probs[i].tolist() == pytest.approx(ref_probs(rows[i], top_k=k), abs=1e-6)
    assert [int((probs[i] > 0).sum()) for i in range(len(ks))] == [3, V, 5, 2]


def test_top_k_above_vocab_size_keeps_everything():
    probs = processed_probs(LOGITS[None], [SamplingParams(top_k=V + 5)])
    assert probs[0].tolist() == pytest.approx(torch.softmax(LOGITS, -1).tolist(), abs=1e-6)


def test_top_p_keeps_smallest_set_reaching_p_per_row():
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS, LOGITS.roll(4)])
    rows = torch.cat([rows, LOGITS[None]])
    ps = [0.7, 0.85, 1.0, 0.3, 1e-8]  # 1 - 1e-8 rounds to 1 in fp32: the top token must still stay
    probs = processed_probs(rows, [SamplingParams(top_p=p) for p in ps])
    for i, p in enumerate(ps):
        assert probs[i].tolist() == pytest.approx(ref_probs(rows[i], top_p=p), abs=1e-6)
    assert [int((row > 0).sum()) for row in probs] == [3, 5, V, 1, 1]


def test_min_p_keeps_tokens_above_fraction_of_max():
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    mps = [0.2, 0.1, 0.0]
    probs = processed_probs(rows, [SamplingParams(min_p=m) for m in mps])
    for i, m in enumerate(mps):
        assert probs[i].tolist() == pytest.approx(ref_probs(rows[i], min_p=m), abs=1e-6)
    assert [int((row > 0).sum()) for row in probs] == [4, 6, V]


def test_temperature_min_p_top_k_top_p_compose_in_order():
    settings = [
        dict(temperature=1.5, min_p=0.1),  # min-p on the raw softmax would keep only 6
        dict(temperature=1.5, min_p=0.1, top_k=4, top_p=0.85),  # top-p before top-k would keep 4
    ]
    probs = processed_probs(LOGITS.repeat(2, 1), [SamplingParams(**kw) for kw in settings])
    for i, kw in enumerate(settings):
        assert probs[i].tolist() == pytest.approx(ref_probs(LOGITS, **kw), abs=1e-6)
    assert [int((row > 0).sum()) for row in probs] == [8, 3]


def test_sampling_draws_only_kept_tokens_in_reference_proportions():
    torch.manual_seed(0)
    settings = dict(temperature=0.8, min_p=0.01, top_k=6, top_p=0.9)
    n = 20000
    freq = sample_many(LOGITS, SamplingParams(**settings), n)
    ref = ref_probs(LOGITS, **settings)
    assert {t for t in range(V) if freq[t] > 0} == {t for t in range(V) if ref[t] > 0}
    for t in range(V):
        assert abs(freq[t] - ref[t]) <= 5 * math.sqrt(ref[t] * (1 - ref[t]) / n)


def test_unseeded_sampling_matches_softmax_over_temperature():
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, -1.0])
    n = 30000
    freq = sample_many(logits, SamplingParams(temperature=0.7), n)
    expected = torch.softmax(logits.double() / 0.7, -1)
    chi2 = float((n * (freq - expected) ** 2 / expected).sum())
    assert chi2 < 30  # 5 degrees of freedom: p < 1e-5 for a correct sampler


def ref_penalise(row, prompt, output, rep, pres, freq, temperature):
    row = row.double().clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(output):
        row[t] -= pres + freq * output.count(t)
    return row / temperature


def test_repetition_presence_frequency_penalties_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    logits[0, 2], logits[0, 1], logits[2, 4] = 1.7, -0.8, -1.2  # seen tokens of both signs
    prompts = [[1, 2, 2], [0], [3, 4]]
    outputs = [[2, 5, 5, 5], [], [4, 4, 7]]
    settings = [(1.3, 0.5, 0.25, 1.0), (2.0, 1.0, 1.0, 1.0), (1.0, -0.5, 1.0, 0.5)]
    params = [
        SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f, temperature=t)
        for r, p, f, t in settings
    ]
    got = Sampler().process_logits(logits.clone(), build(params, prompts=prompts, outputs=outputs))
    for i, (r, p, f, t) in enumerate(settings):
        want = ref_penalise(logits[i], prompts[i], outputs[i], r, p, f, t)
        assert got[i].tolist() == pytest.approx(want.tolist(), abs=1e-5)


def test_neutral_penalties_build_no_token_statistics():
    neutral = build([SamplingParams(), SamplingParams(temperature=0.0)], outputs=[[1, 1], [2]])
    assert neutral.penalties is None
    one = build([SamplingParams(), SamplingParams(presence_penalty=0.1)], outputs=[[1, 1], [2]])
    assert one.penalties.output_counts[0].tolist() == [0, 2] + [0] * (V - 2)


def test_penalty_state_counts_each_step_and_resets_a_reused_row():
    state = penalty_state([[1, 2], [3]], [[4, 4, 5], [6]])
    assert state.output_counts[0].tolist() == [0, 0, 0, 0, 2, 1] + [0] * (V - 6)
    assert state.prompt_seen[1].nonzero().flatten().tolist() == [3]
    state.start(0, [7], 2)  # row 0 now holds a new request: nothing of the old one may remain
    assert state.output_counts[0].sum() == 0 and state.prompt_seen[0].nonzero().flatten().tolist() == [7]
    assert state.output_counts[1].tolist() == [0] * 6 + [1] + [0] * (V - 7)
    state.start(3, [2], 4)  # the runner grew to 4 rows
    assert state.output_counts.shape == (4, V) and state.prompt_seen[3, 2]
    penalties = state.penalties([SamplingParams(presence_penalty=1.0)] * 2, torch.tensor([1, 3]))
    assert penalties.seen.nonzero().tolist() == [[0, 3], [0, 6], [1, 2]]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    eos, stop = 9, 8
    logits = LOGITS.repeat(4, 1)
    logits[:, eos], logits[:, stop] = 10.0, 9.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),  # 1 output: banned
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),  # 3 outputs: free
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=1),
    ]  # EOS banned, its stop id is not
    outputs = [[0], [0, 1, 2], [], []]
    metadata = build(params, outputs=outputs, eos=eos)
    processed = Sampler().process_logits(logits.clone(), metadata)
    banned = {(0, eos), (0, stop), (2, eos), (2, stop), (3, eos)}
    for i in range(4):
        for t in range(V):
            want = NEG_INF if (i, t) in banned else logits[i, t].item()
            assert processed[i, t].item() == want
    sampled, _ = Sampler()(logits.clone(), build(params, outputs=outputs, eos=eos))
    assert sampled.tolist() == [0, eos, 0, stop]


def seeded_stream(seed, *, batch, position, global_seed, steps=20):
    """Tokens one seeded request samples over `steps` steps, placed at `position` in
    a batch of `batch` rows whose other rows (random, greedy, another seed) vary."""
    torch.manual_seed(global_seed)
    target = torch.linspace(-1.0, 1.0, 50)
    gen = torch.Generator().manual_seed(seed)
    other_gen = torch.Generator().manual_seed(seed + 1000)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(batch, 50)
        logits[position] = target
        params = [
            SamplingParams(seed=0) if i == 0 else SamplingParams(temperature=0.0 if i == 1 else 1.3)
            for i in range(batch)
        ]
        generators = [other_gen if i == 0 else None for i in range(batch)]
        params[position], generators[position] = SamplingParams(seed=seed), gen
        sampled, _ = Sampler()(logits, build(params, generators=generators, vocab=50))
        tokens.append(sampled[position].item())
    return tokens


def test_seeded_request_is_reproducible_and_independent_of_its_batch():
    alone = seeded_stream(7, batch=1, position=0, global_seed=0)
    assert len(set(alone)) > 5  # a real random stream, not a constant
    assert seeded_stream(7, batch=1, position=0, global_seed=0) == alone
    assert seeded_stream(7, batch=4, position=2, global_seed=1) == alone
    assert seeded_stream(7, batch=3, position=1, global_seed=2) == alone


def test_different_seeds_give_different_streams():
    a = seeded_stream(7, batch=2, position=1, global_seed=0)
    b = seeded_stream(8, batch=2, position=1, global_seed=0)
    assert a != b


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0.0),
    ]
    sampled, rows = Sampler()(logits.clone(), build(params, outputs=[[1, 2], [], []]))
    out = rows.to_list()
    assert out[1] is None
    assert out[2] == SampledLogprobs(
        logprob=pytest.approx(raw[2, sampled[2]].item(), abs=1e-6), top_token_ids=[], top_logprobs=[]
    )
    first = out[0]
    assert first.logprob == pytest.approx(raw[0, sampled[0]].item(), abs=1e-6)
    assert first.top_token_ids == raw[0].argsort(descending=True)[:3].tolist()
    assert first.top_logprobs == pytest.approx(raw[0].sort(descending=True).values[:3].tolist(), abs=1e-6)


def test_no_logprobs_requested_returns_none():
    metadata = build([SamplingParams(), SamplingParams(temperature=0.0)])
    assert metadata.max_num_logprobs is None
    assert Sampler()(torch.randn(2, V), metadata)[1] is None


def test_logit_bias_and_allowed_token_ids_act_per_row():
    params = [
        SamplingParams(temperature=0, logit_bias={9: 100.0, 0: -100}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, allowed_token_ids=[3, 7]),
    ]
    logits = Sampler().process_logits(LOGITS.repeat(3, 1), build(params))
    assert logits[0, 9] == LOGITS[9] + 100 and logits[0, 0] == LOGITS[0] - 100
    assert torch.equal(logits[1], LOGITS)
    assert torch.isinf(logits[2]).tolist() == [t not in (3, 7) for t in range(V)]
    assert Sampler()(LOGITS.repeat(3, 1), build(params))[0].tolist() == [9, 0, 3]


def test_a_grammar_bitmask_leaves_only_its_tokens():
    import numpy as np

    from workers.structured_output import unpack_banned

    # row 1: tokens 0, 5, 31 and 33 (the second 32-bit word); bit 31 makes the word negative as an int32
    bitmask = np.array([[(1 << 0) | (1 << 5) | -(1 << 31), 1 << 1]], dtype=np.int32)
    params = [SamplingParams(temperature=0)] * 3
    metadata = build(params, vocab=40)
    metadata.grammar = torch.from_numpy(unpack_banned(bitmask, [1], 3, 40))
    logits = Sampler().process_logits(torch.randn(3, 40), metadata)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 5, 31, 33]
    assert torch.isfinite(logits[[0, 2]]).all()


def test_bad_words_ban_the_token_that_would_complete_them():
    params = [SamplingParams(temperature=0, bad_words_token_ids=[[0], [4, 5, 1]])] * 3
    outputs = [[], [4], [7, 4, 5]]  # row 2 has written all of [4, 5, 1] but its last token
    metadata = SamplingMetadata.build(params, [None] * 3, [len(o) for o in outputs], None, V, "cpu", None, outputs)
    logits = Sampler().process_logits(LOGITS.repeat(3, 1), metadata)
    assert [torch.isinf(row).nonzero().flatten().tolist() for row in logits] == [[0], [0], [0, 1]]
