import subprocess
import sys
from pathlib import Path

import pytest

from scheduler import EngineRequest, Request, RequestStatus, SamplingParams, Scheduler
from tests.scheduler.configs import scheduler_config
from tests.scheduler.fake_worker import FakeState, FakeWorker

EOS = 999


def make(num_blocks=64, block_size=4, **kw) -> tuple[Scheduler, FakeWorker]:
    cfg = scheduler_config(num_blocks, block_size=block_size, **kw)
    return Scheduler(cfg, eos_token_id=EOS), FakeWorker(block_size, num_blocks, eos_token_id=EOS)


def step(sched: Scheduler, worker: FakeWorker):
    so = sched.schedule()
    return so, sched.update_from_output(so, worker.execute(so))


def run_all(sched, worker, max_steps=1000) -> dict[tuple[str, int], list]:
    """Step until nothing is left; collect (tokens, finish_reason) per (caller id, index)."""
    got: dict[tuple[str, int], list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return got
        _, outs = step(sched, worker)
        for o in outs:
            entry = got.setdefault((o.request_id, o.index), [[], None])
            entry[0].extend(o.new_token_ids)
            if o.finished:
                entry[1] = o.finish_reason
    raise AssertionError("requests never finished")


def params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 5)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def test_scheduler_package_never_imports_torch():
    root = Path(__file__).resolve().parents[2]
    for path in (root / "scheduler").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path
    code = "import sys, scheduler, scheduler.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        # wrong types and non-finite values: ValueError here, not a TypeError or NaN later in the sampler
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"min_p": "0"}, "min_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": False}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"min_tokens": "1"}, "min_tokens"),
        ({"n": 2.0}, "n"),
        ({"top_k": None}, "top_k"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"seed": "1"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": None}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"stop": 7}, "stop"),
        ({"stop": ["a", None]}, "stop"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"disable_spec_decode": 1}, "disable_spec_decode"),
        ({"pooling": "cls", "max_tokens": 1}, "pooling"),
        ({"pooling": "last", "max_tokens": 2}, "pooling"),
        ({"dimensions": 8}, "dimensions"),
        ({"pooling": "last", "max_tokens": 1, "dimensions": 0}, "dimensions"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(kw, field):
    (value,) = [v for k, v in kw.items() if k == field]
    with pytest.raises(ValueError, match=f"^{field}=") as e:
        SamplingParams(**kw)
    assert repr(value) in str(e.value)


def test_sampling_params_accept_the_edges_of_their_ranges():
    p = SamplingParams(temperature=2, top_p=1, repetition_penalty=3, seed=2**64 - 1, stop_token_ids=(5,))
    assert p.temperature == 2.0 and type(p.temperature) is float and p.stop_token_ids == [5]
    assert SamplingParams(stop="END").stop == ["END"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)  # torch.Generator.manual_seed's range
    # Below 1e-5 a temperature would overflow the logits it divides: such rows are greedy, as in vLLM.
    assert SamplingParams(temperature=1e-30).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_child_seeds_wrap_within_the_generator_seed_range():
    sched, _ = make()
    sched.add_request(
        EngineRequest(request_id="p", prompt_token_ids=[1, 2, 3], sampling_params=params(n=3, seed=2**64 - 2))
    )
    assert [sched.requests[f"p#{i}"].sampling_params.seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    sched.add_request(
        EngineRequest(request_id="q", prompt_token_ids=[1, 2, 3], sampling_params=params(n=2, seed=-1))
    )  # -1 is the generator of 2**64 - 1
    assert [sched.requests[f"q#{i}"].sampling_params.seed for i in range(2)] == [2**64 - 1, 0]


def test_bad_requests_raise_value_errors_and_leave_the_scheduler_usable():
    sched, worker = make()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(EngineRequest(request_id="empty", prompt_token_ids=[]))
    with pytest.raises(ValueError, match="-3"):
        sched.add_request(EngineRequest(request_id="neg", prompt_token_ids=[1, -3]))
    with pytest.raises(ValueError, match="priority"):
        sched.add_request(EngineRequest(request_id="prio", prompt_token_ids=[1], priority="high"))
    with pytest.raises(ValueError, match=str(2**63)):  # block hashing packs ids as int64
        sched.add_request(EngineRequest(request_id="huge", prompt_token_ids=[1, 2**63], sampling_params=params()))
    with pytest.raises(ValueError, match="True"):
        sched.add_request(EngineRequest(request_id="bool", prompt_token_ids=[1, True], sampling_params=params()))
    with pytest.raises(ValueError, match="prompt_token_ids is a str"):
        sched.add_request(EngineRequest(request_id="text", prompt_token_ids="hello", sampling_params=params()))
    with pytest.raises(ValueError, match="cache_salt=5"):
        sched.add_request(
            EngineRequest(request_id="salt", prompt_token_ids=[1], sampling_params=params(), cache_salt=5)
        )
    assert not sched.has_unfinished_requests() and sched.children == {}
    sched.add_request(EngineRequest(request_id="ok", prompt_token_ids=[1, 2, 3], sampling_params=params()))
    with pytest.raises(ValueError, match="'ok'"):
        sched.add_request(EngineRequest(request_id="ok", prompt_token_ids=[4], sampling_params=params()))
    assert sched.abort("nobody") == []
    got = run_all(sched, worker)
    assert got == {("ok", 0): [got[("ok", 0)][0], "length"]} and len(got[("ok", 0)][0]) == 5


def test_new_requests_travel_once_then_only_diffs():
    sched, worker = make(block_size=4)
    sched.add_request(
        EngineRequest(request_id="a", prompt_token_ids=[1, 2, 3, 4, 5, 6], sampling_params=params(max_tokens=6))
    )
    so, _ = step(sched, worker)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"] and so.scheduled_cached_reqs.num_reqs == 0
    assert so.scheduled_new_reqs[0].block_ids == [1, 2]
    so, _ = step(sched, worker)  # 7th token fits in block 2
    assert so.scheduled_new_reqs == []
    c = so.scheduled_cached_reqs
    assert c.req_ids == ["a"] and c.new_block_ids == [[]] and c.num_computed_tokens == [6]
    assert c.num_computed_tokens == [6] and so.num_scheduled_tokens == {"a": 1}
    so, _ = step(sched, worker)  # 8th token still fits
    so, _ = step(sched, worker)  # 9th token needs a new block: only its id travels
    assert so.scheduled_cached_reqs.new_block_ids == [[3]]
    run_all(sched, worker)
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty


def test_prefix_hits_across_requests_in_the_scheduler():
    sched, worker = make(block_size=4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=prompt, sampling_params=params(max_tokens=3)))
    step(sched, worker)
    sched.add_request(
        EngineRequest(request_id="b", prompt_token_ids=prompt[:12] + [7, 7], sampling_params=params(max_tokens=3))
    )
    so, _ = step(sched, worker)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and so.num_scheduled_tokens["b"] == 2
    a_blocks = sched.kv.get_block_ids("a")
    assert new.block_ids[:3] == a_blocks[:3]
    assert [sched.kv.block_pool.blocks[i].ref_cnt for i in a_blocks[:3]] == [2, 2, 2]
    st = sched.stats()
    assert st.prefix_cache_hits == 12 and st.prefix_cache_queries == 13 + 14
    run_all(sched, worker)
    assert all(b.ref_cnt == 0 for b in sched.kv.block_pool.blocks)


def test_reset_prefix_cache_forgets_every_hash_and_never_caches_a_live_requests_kv():
    sched, worker = make(block_size=4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=prompt, sampling_params=params(max_tokens=2)))
    run_all(sched, worker)
    sched.add_request(EngineRequest(request_id="live", prompt_token_ids=prompt, sampling_params=params(max_tokens=9)))
    step(sched, worker)  # "live" hit a's blocks and holds them
    assert sched.reset_prefix_cache() is True
    assert not sched.kv.block_pool.cached_blocks and all(b.block_hash is None for b in sched.kv.block_pool.blocks)
    run_all(sched, worker)  # "live" fills blocks from KV older than the reset: none may enter the cache
    assert not sched.kv.block_pool.cached_blocks
    sched.add_request(EngineRequest(request_id="b", prompt_token_ids=prompt, sampling_params=params(max_tokens=2)))
    so, _ = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # computed afresh: nothing stale was hit
    run_all(sched, worker)
    assert len(sched.kv.block_pool.cached_blocks) == 3  # a request admitted after the reset caches again
    assert sched.kv.block_pool.num_free_blocks == sched.kv.num_usable_blocks and not sched.kv.uncacheable


def test_prefix_stats_count_a_request_that_waits_for_memory_once():
    # 6 usable blocks of 4 tokens.
    sched, worker = make(num_blocks=7, block_size=4)
    prompt = list(range(100, 109))  # 9 tokens: 2 full blocks get cached
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=prompt, sampling_params=params(max_tokens=1)))
    step(sched, worker)
    # "hog" takes 4 of the 6 blocks for 3 steps; "b" needs its 2 cached (free) blocks plus one more.
    sched.add_request(
        EngineRequest(request_id="hog", prompt_token_ids=list(range(200, 213)), sampling_params=params(max_tokens=3))
    )
    sched.add_request(
        EngineRequest(request_id="b", prompt_token_ids=prompt[:8] + [7, 7, 7], sampling_params=params(max_tokens=1))
    )
    waited = 0
    while True:
        so, outs = step(sched, worker)
        if "b" in so.num_scheduled_tokens:
            break
        waited += 1
    assert waited == 3 and so.scheduled_new_reqs[0].num_computed_tokens == 8
    st = sched.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (9 + 13 + 11, 8)


def test_prefix_caching_off_never_hits():
    sched, worker = make(block_size=4, enable_prefix_caching=False)
    prompt = list(range(13))
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=prompt, sampling_params=params(max_tokens=2)))
    run_all(sched, worker)
    sched.add_request(EngineRequest(request_id="b", prompt_token_ids=prompt, sampling_params=params(max_tokens=2)))
    so, _ = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_fcfs_preempts_the_last_running_request_and_it_resumes():
    # 9 usable blocks of 4 tokens; three 8-token prompts growing 8 tokens each cannot all fit.
    sched, worker = make(num_blocks=10, block_size=4)
    for rid in "abc":
        sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
        )
    preempted_order = []
    got = {}
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched, worker)
        preempted_order += sorted(so.preempted_req_ids)
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert preempted_order and preempted_order[0] == "c"
    assert sched.stats().num_preemptions >= 1
    assert {k: len(v) for k, v in got.items()} == {"a": 8, "b": 8, "c": 8}


def test_priority_policy_preempts_the_lowest_priority_even_if_earlier():
    sched, worker = make(num_blocks=10, block_size=4, policy="priority")
    sched.add_request(
        EngineRequest(
            request_id="low",
            prompt_token_ids=[1] * 8,
            sampling_params=params(max_tokens=8),
            priority=5,
            arrival_time=0.0,
        )
    )
    sched.add_request(
        EngineRequest(
            request_id="high",
            prompt_token_ids=[2] * 8,
            sampling_params=params(max_tokens=8),
            priority=0,
            arrival_time=1.0,
        )
    )
    sched.add_request(
        EngineRequest(
            request_id="mid",
            prompt_token_ids=[3] * 8,
            sampling_params=params(max_tokens=8),
            priority=1,
            arrival_time=2.0,
        )
    )
    first, _ = step(sched, worker)
    assert [n.req_id for n in first.scheduled_new_reqs] == ["high", "mid", "low"]  # priority order
    preempted = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, worker)
        preempted += sorted(so.preempted_req_ids)
    assert preempted[0] == "low"


def test_priority_victim_already_scheduled_this_step_is_taken_back():
    # "low" runs first in the batch; the others join later, so the priority victim is running[0], not running[-1].
    sched, worker = make(num_blocks=7, block_size=4, policy="priority")
    sched.add_request(
        EngineRequest(request_id="low", prompt_token_ids=[1] * 6, sampling_params=params(max_tokens=8), priority=5)
    )
    step(sched, worker)
    sched.add_request(
        EngineRequest(request_id="high", prompt_token_ids=[2] * 12, sampling_params=params(max_tokens=8), priority=0)
    )
    sched.add_request(
        EngineRequest(request_id="mid", prompt_token_ids=[3] * 2, sampling_params=params(max_tokens=8), priority=1)
    )
    step(sched, worker)
    low = sched.requests["low"]
    assert [r.request_id for r in sched.running] == ["low", "high", "mid"]
    assert sched.kv.block_pool.num_free_blocks == 0 and (low.num_computed_tokens, low.num_tokens) == (7, 8)
    # low's decode is scheduled (its block has room), then high needs a block and low must go; mid still runs.
    so = sched.schedule()
    assert so.preempted_req_ids == {"low"} and low.status == RequestStatus.PREEMPTED
    assert so.num_scheduled_tokens == {"high": 1, "mid": 1}
    assert so.scheduled_cached_reqs.req_ids == ["high", "mid"]
    assert so.total_num_scheduled_tokens == 2 and sched.stats().num_scheduled_tokens == 2  # low's token returned
    assert (low.num_computed_tokens, low.num_output_placeholders) == (0, 0)  # its decode was taken back whole
    sched.update_from_output(so, worker.execute(so))
    got = {rid: tokens for (rid, _), (tokens, _) in run_all(sched, worker).items()}
    roomy, roomy_worker = make(num_blocks=64, block_size=4, policy="priority")
    for rid, prompt, priority in (("low", [1] * 6, 5), ("high", [2] * 12, 0), ("mid", [3] * 2, 1)):
        roomy.add_request(
            EngineRequest(
                request_id=rid, prompt_token_ids=prompt, sampling_params=params(max_tokens=8), priority=priority
            )
        )
    expected = {rid: tokens for (rid, _), (tokens, _) in run_all(roomy, roomy_worker).items()}
    assert {rid: len(t) for rid, t in got.items()} == {"low": 6, "high": 6, "mid": 6}  # 2 of each came before
    assert all(got[rid] == expected[rid][2:] for rid in got)


def test_preempted_request_resumes_with_its_tokens_and_finishes_identically():
    base = {}
    for blocks in (64, 10):
        sched, worker = make(num_blocks=blocks, block_size=4)
        for rid in "abc":
            sched.add_request(
                EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
            )
        base[blocks] = run_all(sched, worker)
    assert base[10] == base[64]  # the fake worker's tokens depend only on each request's history


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_running():
    sched, worker = make(num_blocks=128, block_size=4, max_num_batched_tokens=32, long_prefill_token_threshold=20)
    sched.add_request(EngineRequest(request_id="d1", prompt_token_ids=[1, 2, 3], sampling_params=params(max_tokens=50)))
    sched.add_request(EngineRequest(request_id="d2", prompt_token_ids=[4, 5, 6], sampling_params=params(max_tokens=50)))
    step(sched, worker)
    sched.add_request(
        EngineRequest(request_id="long", prompt_token_ids=list(range(300, 400)), sampling_params=params(max_tokens=2))
    )
    chunks = []
    while True:
        so, _ = step(sched, worker)
        assert so.num_scheduled_tokens["d1"] == 1 and so.num_scheduled_tokens["d2"] == 1
        chunks.append(so.num_scheduled_tokens.get("long", 0))
        if sum(chunks) >= 100:
            break
    assert chunks == [20, 20, 20, 20, 20]  # the threshold caps each chunk; the decodes never wait


def test_token_budget_limits_a_prefill_chunk():
    sched, worker = make(num_blocks=128, block_size=4, max_num_batched_tokens=16)
    sched.add_request(
        EngineRequest(request_id="long", prompt_token_ids=list(range(40)), sampling_params=params(max_tokens=1))
    )
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"long": 16}


def test_max_num_seqs_caps_the_running_batch():
    sched, worker = make(max_num_seqs=2)
    for i in range(4):
        sched.add_request(
            EngineRequest(request_id=f"r{i}", prompt_token_ids=[i + 1], sampling_params=params(max_tokens=3))
        )
    so, _ = step(sched, worker)
    assert sorted(so.num_scheduled_tokens) == ["r0", "r1"]
    assert sched.stats().num_waiting == 2


@pytest.mark.parametrize("steps_in_flight, per_step", [(1, 6), (2, 3)])
def test_pipelined_steps_split_the_batch_only_over_the_steps_in_flight(steps_in_flight, per_step):
    """Two stages: with two steps in flight each takes half the requests, so both stages have work; with one
    (the serial loop) a step that took half would leave the other half idle until the next."""
    sched, worker = make(pipeline_parallel_size=2, steps_in_flight=steps_in_flight)
    for i in range(6):
        sched.add_request(
            EngineRequest(request_id=f"r{i}", prompt_token_ids=[i + 1, i + 2], sampling_params=params(max_tokens=4))
        )
    so, _ = step(sched, worker)
    assert len(so.num_scheduled_tokens) == per_step
    so, _ = step(sched, worker)
    assert len(so.num_scheduled_tokens) == per_step


def test_abort_waiting_running_and_preempted_requests_frees_blocks():
    sched, worker = make(num_blocks=10, block_size=4)
    for rid in "abc":
        sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
        )
    sched.add_request(EngineRequest(request_id="w", prompt_token_ids=[5] * 30, sampling_params=params(max_tokens=2)))
    preempted = set()
    while not preempted:
        so, _ = step(sched, worker)
        preempted |= so.preempted_req_ids
    (victim,) = preempted
    statuses = {r: sched.requests[r].status for r in "abcw"}
    assert statuses[victim] == RequestStatus.PREEMPTED and statuses["w"] == RequestStatus.WAITING
    running = next(r for r in "abc" if statuses[r] == RequestStatus.RUNNING)
    for rid in (victim, "w", running):
        (out,) = sched.abort(rid)
        assert out.finished and out.finish_reason == "abort" and out.request_id == rid
    assert sched.abort(victim) == []  # a second abort is a no-op
    so, _ = step(sched, worker)
    assert running in so.finished_req_ids and victim in so.finished_req_ids
    assert "w" not in so.finished_req_ids  # the workers never held it
    run_all(sched, worker)
    assert all(b.ref_cnt == 0 for b in sched.kv.block_pool.blocks)


def test_infeasible_requests_finish_at_once_with_a_reason():
    sched, worker = make(num_blocks=5, block_size=4, max_model_len=64)
    (out,) = sched.add_request(
        EngineRequest(request_id="too_long", prompt_token_ids=list(range(64)), sampling_params=params())
    )
    assert out.finished and out.finish_reason == "error" and "max_model_len=64" in out.error
    (out,) = sched.add_request(
        EngineRequest(request_id="too_big", prompt_token_ids=list(range(10)), sampling_params=params(max_tokens=20))
    )
    assert "KV blocks" in out.error and out.request_id == "too_big"
    assert not sched.has_unfinished_requests()
    sched.add_request(
        EngineRequest(request_id="fits", prompt_token_ids=list(range(10)), sampling_params=params(max_tokens=6))
    )
    assert run_all(sched, worker)[("fits", 0)][1] == "length"


@pytest.mark.parametrize(
    "kw, expect_len, reason",
    [
        ({"ignore_eos": False}, 6, "stop"),  # the fake model emits EOS at history length 10: output 6
        ({"ignore_eos": True}, 8, "length"),
        ({"ignore_eos": False, "min_tokens": 7}, 8, "length"),  # EOS before min_tokens does not stop
    ],
)
def test_stop_rules(kw, expect_len, reason):
    sched = Scheduler(scheduler_config(64, block_size=4), eos_token_id=EOS)
    worker = FakeWorker(4, 64, eos_token_id=EOS, eos_every=10)
    sched.add_request(
        EngineRequest(
            request_id="r", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=SamplingParams(max_tokens=8, **kw)
        )
    )
    tokens, why = run_all(sched, worker)[("r", 0)]
    assert len(tokens) == expect_len and why == reason


def test_stop_token_ids_and_max_model_len():
    sched, worker = make(max_model_len=9)
    sched.add_request(
        EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=params(max_tokens=50))
    )
    tokens, why = run_all(sched, worker)[("r", 0)]
    assert len(tokens) == 4 and why == "length"
    # The fake model's third token for "s" (history of 4 tokens) becomes a stop token.
    third = FakeWorker(4, 64).next_token("s", FakeState([0] * 4, [], 0))
    sched, worker = make()
    sched.add_request(
        EngineRequest(
            request_id="s", prompt_token_ids=[1, 2], sampling_params=params(max_tokens=5, stop_token_ids=[third])
        )
    )
    tokens, why = run_all(sched, worker)[("s", 0)]
    assert why == "stop" and tokens[-1] == third and len(tokens) == 3


def test_n_children_share_the_prompt_blocks_and_finish_separately():
    sched, worker = make(block_size=4)
    prompt = list(range(200, 217))  # 17 tokens: 4 full blocks
    sched.add_request(
        EngineRequest(request_id="p", prompt_token_ids=prompt, sampling_params=params(max_tokens=3, n=3, seed=1))
    )
    so, _ = step(sched, worker)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["p#0"]  # siblings wait for the prompt
    so, _ = step(sched, worker)
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert set(new) == {"p#1", "p#2"}
    shared = sched.kv.get_block_ids("p#0")[:4]
    for n in new.values():
        assert n.num_computed_tokens == 16 and n.block_ids[:4] == shared
        assert n.sampling_params.n == 1
    assert [new[f"p#{i}"].sampling_params.seed for i in (1, 2)] == [2, 3]
    assert all(sched.kv.block_pool.blocks[b].ref_cnt == 3 for b in shared)
    got = run_all(sched, worker)
    assert sorted(got) == [("p", 0), ("p", 1), ("p", 2)]
    # child 0 sampled in the two steps above; its siblings from the second on
    assert [len(got[("p", i)][0]) for i in range(3)] == [1, 2, 2]
    assert all(why == "length" for _, why in got.values())
    assert sched.abort("p") == [] and "p" not in sched.children


def test_abort_of_a_parent_spares_an_unrelated_request_reusing_a_finished_child_id():
    sched, worker = make(block_size=4)
    sched.add_request(
        EngineRequest(request_id="p", prompt_token_ids=[1, 2, 3], sampling_params=params(n=2, max_tokens=2))
    )
    step(sched, worker)  # p#0 computes the prompt; p#1 is released
    _, outs = step(sched, worker)
    assert [(o.index, o.finished) for o in outs] == [(0, True), (1, False)]  # p#0 done, p#1 still running
    assert (
        sched.add_request(
            EngineRequest(request_id="p#0", prompt_token_ids=[4, 5], sampling_params=params(max_tokens=3))
        )
        == []
    )  # an unrelated caller's id
    (out,) = sched.abort("p")
    assert (out.request_id, out.index, out.finish_reason) == ("p", 1, "abort")
    assert sched.requests["p#0"].status == RequestStatus.WAITING and "p" not in sched.children
    got = run_all(sched, worker)
    assert list(got) == [("p#0", 0)] and len(got[("p#0", 0)][0]) == 3 and got[("p#0", 0)][1] == "length"
    assert sched.children == {}


def test_abort_of_a_parent_aborts_deferred_children():
    sched, worker = make(block_size=4)
    sched.add_request(EngineRequest(request_id="p", prompt_token_ids=list(range(17)), sampling_params=params(n=2)))
    outs = sched.abort("p")
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort")]
    assert not sched.has_unfinished_requests()


def test_stats_count_running_waiting_and_usage():
    sched, worker = make(num_blocks=11, block_size=4, max_num_seqs=1)
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=[1] * 8, sampling_params=params(max_tokens=4)))
    sched.add_request(EngineRequest(request_id="b", prompt_token_ids=[2] * 8, sampling_params=params(max_tokens=4)))
    step(sched, worker)
    st = sched.stats()
    assert (st.num_running, st.num_waiting, st.num_steps, st.num_admitted) == (1, 1, 1, 1)
    assert st.kv_cache_usage == pytest.approx(2 / 10)  # 8 computed tokens -> 2 of 10 usable blocks
    assert st.num_scheduled_tokens == 8


def test_adapter_is_part_of_the_prefix_cache_key():
    prompt = list(range(1, 13))
    salted = Request(EngineRequest(request_id="a", prompt_token_ids=prompt, cache_salt="t"), block_size=4)
    assert (
        salted.block_hashes
        == Request(EngineRequest(request_id="b", prompt_token_ids=prompt, cache_salt="t"), block_size=4).block_hashes
    )
    under = [
        Request(EngineRequest(request_id=str(i), prompt_token_ids=prompt, lora_name=name), block_size=4).block_hashes
        for i, name in enumerate("xxy")
    ]
    assert under[0] == under[1]
    assert not set(under[0]) & set(under[2])
    assert not set(under[0]) & set(
        Request(EngineRequest(request_id="c", prompt_token_ids=prompt), block_size=4).block_hashes
    )


def test_requests_of_an_adapter_beyond_max_loras_wait_for_a_slot():
    sched, worker = make(max_loras=1)
    sched.add_request(
        EngineRequest(request_id="x1", prompt_token_ids=[1, 2, 3], sampling_params=params(), lora_name="x")
    )
    sched.add_request(
        EngineRequest(request_id="y1", prompt_token_ids=[1, 2, 3], sampling_params=params(), lora_name="y")
    )
    sched.add_request(
        EngineRequest(request_id="x2", prompt_token_ids=[4, 5, 6], sampling_params=params(), lora_name="x")
    )
    so, _ = step(sched, worker)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["x1"]  # y1 waits for x's slot; x2 waits behind it
    assert [n.lora_name for n in so.scheduled_new_reqs] == ["x"]
    got = run_all(sched, worker)
    assert {rid for rid, _ in got} == {"x1", "y1", "x2"} and all(reason == "length" for _, reason in got.values())
