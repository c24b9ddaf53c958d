"""The offline engine end to end: greedy output token-identical to transformers, and its API.

The shared ``smol`` LLM runs on the Ray engine (the default executor); the
scheduling variants run in-process, which takes the same step without actors.
"""

import json
import subprocess
import sys

import jsonschema
import pytest
import ray
import torch

from engine.config import GIB
from engine.inprocess import InProcessEngine
from raylm import LLM, EngineConfig, SamplingParams
from scheduler import EngineRequest, RequestError, StructuredOutputsParams

NEW_TOKENS = 32
BASE = (
    "The history of the Roman empire is long and complicated. It began when the city of Rome was "
    "founded, and over many centuries it grew into a vast state spanning three continents. "
)
PROMPTS = [
    "Hello",
    "What is the capital of France?",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    BASE + "Its first emperor was",
    BASE + "The fall of the western half happened because",
    BASE * 2 + "In summary,",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,",
]


def hf_greedy(
    model_dir: str, prompt_ids: list[list[int]], new_tokens: int, ignore_eos: bool = False
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # eos_token_id=None: generate all new_tokens, as SamplingParams(ignore_eos=True) does (min_new_tokens
    # would instead mask EOS out of the greedy choice).
    no_eos = {"eos_token_id": None} if ignore_eos else {}
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=model.generation_config.eos_token_id,
                **no_eos,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def smol(default_model_dir, ray_session):
    llm = LLM(model=default_model_dir)
    assert type(llm.engine).__name__ == "RayEngine"
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return llm, ids, hf_greedy(default_model_dir, ids, NEW_TOKENS)


def greedy(max_tokens=NEW_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_same(outs, expected):
    for i, (o, want) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == want, f"prompt {i} differs from transformers"


def test_prompts_cover_several_blocks_and_shared_prefixes(smol):
    _, ids, _ = smol
    assert min(map(len, ids)) <= 3 and max(map(len, ids)) > 4 * 16
    assert ids[4][:32] == ids[5][:32]  # two full blocks shared


def test_greedy_matches_transformers_with_prefix_caching(smol):
    llm, ids, expected = smol
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    # Again: the shared prefixes now come from the prefix cache.
    before = llm.engine.stats().prefix_cache_hits
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    assert llm.engine.stats().prefix_cache_hits > before


def test_greedy_matches_transformers_without_prefix_caching(smol, default_model_dir):
    _, ids, expected = smol
    llm = LLM(model=default_model_dir, executor="inprocess", enable_prefix_caching=False)
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    assert llm.engine.stats().prefix_cache_hits == 0


def test_greedy_matches_transformers_with_chunked_prefill(smol, default_model_dir):
    _, ids, expected = smol
    llm = LLM(model=default_model_dir, executor="inprocess", max_num_batched_tokens=48, long_prefill_token_threshold=20)
    steps = []
    engine = llm.engine
    original = engine.scheduler.schedule

    def spy():
        so = original()
        steps.append(dict(so.num_scheduled_tokens))
        return so

    engine.scheduler.schedule = spy
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    # every step kept the budget, and long prompts went in chunks of the threshold
    assert max(map(len, ids)) > 3 * 20
    assert all(sum(s.values()) <= 48 for s in steps)
    assert sum(1 for s in steps for n in s.values() if n == 20) >= 3


def test_greedy_matches_transformers_under_preemption(smol, default_model_dir):
    _, ids, expected = smol
    block_bytes = ray.get(smol[0].engine.workers[0].call.remote("block_bytes"))
    # Room for ~2 long requests at once: the others must be preempted and recomputed.
    llm = LLM(model=default_model_dir, executor="inprocess", kv_cache_bytes=block_bytes * 24)
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    assert llm.engine.stats().num_preemptions > 0


def test_greedy_matches_transformers_under_swap_preemption_without_recomputing(smol, default_model_dir):
    _, ids, expected = smol
    block_bytes = ray.get(smol[0].engine.workers[0].call.remote("block_bytes"))
    llm = LLM(
        model=default_model_dir,
        executor="inprocess",
        kv_cache_bytes=block_bytes * 24,
        swap_space=block_bytes * 64 / GIB,
        preemption_mode="swap",
        enable_prefix_caching=False,
    )
    computed = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: computed.append((so := schedule()).total_num_scheduled_tokens) or so
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_blocks_swapped_in > 0 and stats.num_swapped == 0
    # Each token's KV was computed once: a swapped request went on from where it stopped.
    assert sum(computed) == sum(len(p) + len(out) - 1 for p, out in zip(ids, expected))


def test_greedy_matches_transformers_with_prefix_hits_from_the_host_tier(smol, default_model_dir):
    _, ids, expected = smol
    block_bytes = ray.get(smol[0].engine.workers[0].call.remote("block_bytes"))
    llm = LLM(
        model=default_model_dir,
        executor="inprocess",
        kv_cache_bytes=block_bytes * 24,
        swap_space=block_bytes * 128 / GIB,
        max_num_seqs=2,
    )
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    before = llm.engine.stats()
    # Again: the later prompts pushed the earlier ones' blocks out of the device pool, into the host tier.
    assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
    after = llm.engine.stats()
    assert after.host_prefix_cache_hits > before.host_prefix_cache_hits
    assert after.num_blocks_swapped_in > before.num_blocks_swapped_in


@pytest.mark.parametrize("model_type, extra", [("qwen2", {}), ("qwen3", {"head_dim": 16}), ("llama", {})])
def test_tiny_random_models_match_transformers(tiny_model_dir, model_type, extra):
    path = tiny_model_dir(model_type, **extra)
    rng = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (5, 19, 40, 70)]
    expected = hf_greedy(path, ids, 16, ignore_eos=True)
    engine = InProcessEngine(EngineConfig(model=path, block_size=8, max_num_batched_tokens=64))
    for i, p in enumerate(ids):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=greedy(16, ignore_eos=True))
        )
    got = {str(i): [] for i in range(len(ids))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    for i, want in enumerate(expected):
        assert len(want) == 16 and got[str(i)] == want, f"{model_type} prompt {i}"


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(smol):
    llm, ids, _ = smol
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate([ids[1]], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([ids[1]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16)] * 3
    batch = llm.generate([ids[0], ids[1], ids[2], ids[3]], [others[0], p, others[1], others[2]], use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    other_seed = (
        llm.generate([ids[1]], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone


def test_n_samples_share_the_prompt_blocks(smol):
    llm, ids, _ = smol
    before = llm.engine.stats().prefix_cache_hits
    prompt = ids[6] + [42]  # a prompt not seen before, several blocks long
    (out,) = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    full_blocks = (len(prompt) - 1) // 16
    assert llm.engine.stats().prefix_cache_hits - before >= 2 * full_blocks * 16
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_and_finish_reasons(smol):
    llm, ids, expected = smol
    (out,) = llm.generate([ids[1]], greedy(5, logprobs=3, ignore_eos=True), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp.top_token_ids[0] == tok and len(lp.top_token_ids) == 3 and lp.logprob <= 0
    (out,) = llm.generate(["Say hi"], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)
    assert out.outputs[0].finish_reason in ("stop", "length") and out.outputs[0].text


def test_stop_strings_cut_transformers_greedy_text_as_the_server_does(smol):
    """Offline stop strings, through the output path the server streams with (engine/output.py): the text is
    transformers' greedy text cut at the stop string (with it, under include_stop_str_in_output), the sample
    finishes "stop", its tokens end with the delta that completed the stop string, and nothing runs on."""
    llm, ids, expected = smol
    free_text = llm.tokenizer.decode(expected[7], skip_special_tokens=True)
    stop = free_text[3:7]  # a few characters into the text: it straddles tokens
    assert stop.strip() and len(expected[7]) == NEW_TOKENS, free_text
    cut = free_text.index(stop)
    plain, included = llm.generate(
        [ids[7]] * 2,
        [greedy(1000, stop=[stop]), greedy(1000, stop=stop, include_stop_str_in_output=True)],
        use_tqdm=False,
    )
    assert not llm.engine.has_unfinished_requests()
    for out, text in ((plain, free_text[:cut]), (included, free_text[: cut + len(stop)])):
        c = out.outputs[0]
        assert (c.text, c.finish_reason) == (text, "stop")
        assert c.token_ids == expected[7][: len(c.token_ids)] and len(c.token_ids) < NEW_TOKENS


def test_bad_input_raises_naming_it_and_leaves_nothing_running(smol, tmp_path):
    """The engine's check refuses request 1; request 0, submitted before it, is aborted."""
    llm, ids, _ = smol
    with pytest.raises(ValueError, match=r"request 1 .*: prompt\[2\]=10000000 is invalid: .*outside the vocabulary"):
        llm.generate([ids[0], [1, 2, 10**7]], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * (llm.engine.max_model_len + 1)], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(tmp_path))


def test_generate_failing_part_way_leaves_nothing_running(tiny_model_dir, default_model_dir):
    """A bad priority is refused before anything is submitted; an interrupt mid-generation (Ctrl-C, raised
    here from the engine's third step) aborts the call's requests; the next generate() runs, and skips deltas
    of requests it did not submit."""
    llm = LLM(
        model=tiny_model_dir("llama"),
        tokenizer=default_model_dir,
        executor="inprocess",
        scheduling_policy="priority",
        kv_cache_bytes=1 << 20,
    )
    engine = llm.engine
    prompts = [[3 + i] * (5 + 7 * i) for i in range(4)]
    with pytest.raises(ValueError, match=r"priority\[2\]='high' is not an int"):
        llm.generate(prompts, greedy(8), priority=[0, 1, "high", 3], use_tqdm=False)
    assert not engine.has_unfinished_requests()

    steps = 0

    def interrupted_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return InProcessEngine.step(engine)

    engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(8, ignore_eos=True), use_tqdm=False)
    del engine.step
    assert steps == 3 and not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0

    engine.add_request(
        EngineRequest(request_id="not-generate's", prompt_token_ids=prompts[0], sampling_params=greedy(4))
    )
    outs = llm.generate(prompts, greedy(8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 4
    assert not engine.has_unfinished_requests()


def test_executor_choice_is_checked(default_model_dir):
    with pytest.raises(ValueError, match="executor='threads'"):
        LLM(model=default_model_dir, executor="threads")
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(model=default_model_dir, executor="inprocess", tensor_parallel_size=2)


def test_raylm_generate_cli(default_model_dir, ray_session):
    """On the Ray engine, joining the session's cluster through --address; and in-process."""
    address = ray.get_runtime_context().gcs_address
    texts = []
    for how in (["--address", address], ["--executor", "inprocess"]):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "cli",
                "generate",
                "--model",
                default_model_dir,
                "--prompt",
                "What is 2+2?",
                "--chat",
                "--max-tokens",
                "12",
                *how,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        texts.append(out.stdout.strip())
    assert texts[0] and texts[0] == texts[1]
    bad = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--model", "/nonexistent/model", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr


CONSTRAINED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "year": {"type": "integer", "minimum": 0, "maximum": 3000},
        "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 3},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}


def constrained(max_tokens=64, **kw):
    return SamplingParams(
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=CONSTRAINED_SCHEMA),
        **{"temperature": 0.0} | kw,
    )


def test_structured_output_under_preemption_and_chunked_prefill_equals_unpreempted(smol, default_model_dir):
    """Each request's matcher lives on the sampling rank and follows the tokens the scheduler accepted: a
    request preempted, recomputed in chunks from the prefix cache and resumed keeps exactly its output."""
    llm, ids, _ = smol
    alone = [llm.generate([p], constrained(), use_tqdm=False)[0].outputs[0] for p in ids]
    for o in alone:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), CONSTRAINED_SCHEMA)
    assert sum(o.finish_reason == "stop" for o in alone) >= len(ids) // 2
    block_bytes = ray.get(llm.engine.workers[0].call.remote("block_bytes"))
    tight = LLM(
        model=default_model_dir,
        executor="inprocess",
        kv_cache_bytes=block_bytes * 24,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=20,
    )
    together = tight.generate(ids, constrained(), use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == [o.token_ids for o in alone]


def test_n_2_with_a_constraint_gives_each_child_its_own_matcher(smol):
    llm, ids, _ = smol
    out = llm.generate([ids[1]], constrained(96, n=2, temperature=1.0, seed=5), use_tqdm=False)[0].outputs
    assert len(out) == 2 and out[0].token_ids != out[1].token_ids
    for o in out:
        assert o.text.startswith("{")
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), CONSTRAINED_SCHEMA)


def test_a_constraint_that_does_not_compile_is_refused_and_nothing_runs_on(smol):
    llm, ids, _ = smol
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    refused = r"request 1 \(prompts\[1\], params\[1\]\): structured_outputs.regex: it does not compile"
    with pytest.raises(RequestError, match=refused) as e:
        llm.generate(ids[:2], [greedy(), bad], use_tqdm=False)
    assert (e.value.field, e.value.value) == ("structured_outputs.regex", "(unclosed")
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"logit_bias=1000000 is invalid: token id outside the vocabulary"):
        llm.generate(ids[:1], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_prompt_logprobs_match_transformers_across_chunks_and_preemption(tiny_model_dir, default_model_dir):
    """prompt_logprobs=k: for each prompt token p >= 1, log P(token p | tokens < p) with its rank and the top k,
    equal to transformers' log_softmax of one full forward, though the 70-token prompt arrives in 16-token chunks,
    is preempted mid-prefill (and the small KV cache preempts more); the prefix cache, which would skip computing
    a prompt, is not used."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    rng = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 9, 70)]
    llm = LLM(
        model=path,
        tokenizer=default_model_dir,
        executor="inprocess",
        block_size=8,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        kv_cache_bytes=1 << 16,
    )
    llm.generate([ids[2]], greedy(2), use_tqdm=False)  # its blocks are now in the prefix cache
    engine, scheduler, mid_prefill = llm.engine, llm.engine.scheduler, []

    def step_preempting_mid_prefill():
        for r in list(scheduler.running):
            if 0 < r.num_computed_tokens < len(r.prompt_token_ids) and not r.num_preemptions:
                scheduler._preempt(r)  # recomputed from 0: the entries already returned must not come twice
                mid_prefill.append(r.request_id)
        return InProcessEngine.step(engine)

    engine.step = step_preempting_mid_prefill
    params = [greedy(24, ignore_eos=True, prompt_logprobs=k) for k in (2, 0, 3)]
    outs = llm.generate(ids, params, use_tqdm=False)
    assert mid_prefill and engine.stats().num_preemptions > len(mid_prefill)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, p, out in zip(ids, params, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        for pos in range(1, len(prompt)):
            got, row = out.prompt_logprobs[pos], want[pos - 1]
            assert got.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
            assert got.rank == int((row > row[prompt[pos]]).sum()) + 1
            top = row.topk(p.prompt_logprobs)
            assert got.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
            assert len(got.top_token_ids) == p.prompt_logprobs


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_embeddings_match_transformers_across_chunks_and_preemption(tiny_model_dir, default_model_dir, pooling):
    """SamplingParams(pooling=...): the final hidden states pooled and normalised equal transformers' last hidden
    state pooled the same way, though the 70-token prompt is computed in 16-token chunks (mean pooling sums them)
    and preempted mid-prefill (its sum restarts); the request ends "stop" with no token, and a prompt already in
    the prefix cache is computed again (a cached token has no hidden state)."""
    from transformers import AutoModel

    path = tiny_model_dir("llama")
    rng = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 9, 70)]
    config = EngineConfig(
        model=path,
        tokenizer=default_model_dir,
        block_size=8,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        kv_cache_bytes=1 << 16,
    )
    engine = InProcessEngine(config)
    params = SamplingParams(max_tokens=1, pooling=pooling)
    outs, mid_prefill = {}, []
    for i, prompt in enumerate([ids[2], *ids]):  # the first run puts the long prompt in the prefix cache
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
    while engine.has_unfinished_requests():
        for r in list(engine.scheduler.running):
            if 0 < r.num_computed_tokens < len(r.prompt_token_ids) and not r.num_preemptions and r.request_id == "3":
                engine.scheduler._preempt(r)
                mid_prefill.append(r.request_id)
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.shutdown()
    assert mid_prefill
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for i, prompt in enumerate(ids, start=1):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
        out = outs[str(i)]
        assert out.finish_reason == "stop" and out.new_token_ids == [] and out.num_cached_tokens == 0
        assert torch.tensor(out.embedding) == pytest.approx(want, abs=1e-4)


def test_embed_a_sentence_transformers_export_with_matryoshka_dimensions(tiny_model_dir, default_model_dir, tmp_path):
    """LLM.embed on a tiny random Qwen3 exported as sentence-transformers does (modules.json, 1_Pooling asking
    for mean pooling) whose config.json lists matryoshka widths: served with runner=auto, pooled as its export
    says, equal to transformers' mean hidden state; dimensions=16 is the first 16 values renormalised; a width
    the config does not list is refused naming dimensions; the same weights without the export refuse embed."""
    import shutil

    from transformers import AutoModel

    plain = tiny_model_dir("qwen3", matryoshka_dimensions=[16, 32])
    export = shutil.copytree(plain, tmp_path / "st")
    (export / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "Transformer"}]))
    (export / "1_Pooling").mkdir()
    (export / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    ids = [[5, 17, 99, 3], list(range(40, 70))]
    llm = LLM(str(export), executor="inprocess", tokenizer=default_model_dir, kv_cache_bytes=1 << 20)
    try:
        full = llm.embed(ids, use_tqdm=False)
        short = llm.embed(ids, dimensions=16, use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions") as refused:
            llm.embed(ids[0], dimensions=24, use_tqdm=False)
    finally:
        llm.shutdown()
    assert refused.value.field == "dimensions"
    model = AutoModel.from_pretrained(plain, dtype=torch.float32).eval()
    for prompt, got, got_short in zip(ids, full, short):
        with torch.no_grad():
            mean = model(torch.tensor([prompt])).last_hidden_state[0].mean(0)
        assert got.prompt_token_ids == prompt and len(got.embedding) == 64 and len(got_short.embedding) == 16
        assert torch.tensor(got.embedding) == pytest.approx(torch.nn.functional.normalize(mean, dim=0), abs=1e-4)
        want_short = torch.nn.functional.normalize(mean[:16], dim=0)
        assert torch.tensor(got_short.embedding) == pytest.approx(want_short, abs=1e-4)
    generative = LLM(plain, executor="inprocess", tokenizer=default_model_dir, kv_cache_bytes=1 << 20)
    try:
        with pytest.raises(ValueError, match="runner pooling"):
            generative.embed(ids)
    finally:
        generative.shutdown()


def test_offline_json_schemas_are_closed_as_the_server_closes_them(smol):
    """A pydantic schema as libraries pass it (no additionalProperties): closed by default offline too, so the
    model stops after the object instead of adding properties until max_tokens."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    llm, _, _ = smol
    ids = llm.apply_chat_template([{"role": "user", "content": "Describe Paris in JSON."}])
    params = greedy(80, structured_outputs=StructuredOutputsParams(json=City.model_json_schema()))
    out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    City.model_validate_json(out.text)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_matches_transformers_with_speculation(smol, default_model_dir, method):
    """Proposals on the Ray engine (async scheduling), with chunked prefill, preemption, the prefix cache and
    n=2 (the second round): token for token transformers'. The draft model is the default model itself: it must
    have every proposal accepted."""
    _, ids, expected = smol
    block_bytes = ray.get(smol[0].engine.workers[0].call.remote("block_bytes"))
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        spec = {"method": "draft_model", "model": default_model_dir, "num_speculative_tokens": 4}
        block_bytes *= 2  # the draft's KV beside the target's
    llm = LLM(
        model=default_model_dir, speculative_config=spec, max_num_batched_tokens=48, kv_cache_bytes=block_bytes * 24
    )
    try:
        assert_same(llm.generate(ids, greedy(), use_tqdm=False), expected)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
        if method == "draft_model":
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
        for out, want in zip(llm.generate(ids, greedy(n=2), use_tqdm=False), expected):
            assert [c.token_ids for c in out.outputs] == [want, want]
        after = llm.engine.stats()
        assert after.prefix_cache_hits > stats.prefix_cache_hits
        assert sum(after.spec_decode_num_accepted_tokens_per_pos) == after.spec_decode_num_accepted_tokens
    finally:
        llm.shutdown()
