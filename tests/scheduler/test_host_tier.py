"""The host tier of the KV cache: preemption by swap, and the host level of the prefix cache."""

import pytest

from scheduler import EngineRequest, RequestStatus, Scheduler
from tests.scheduler.configs import scheduler_config
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.test_scheduler import EOS, params, run_all, step


def make(num_blocks=10, block_size=4, num_host_blocks=32, **kw) -> tuple[Scheduler, FakeWorker]:
    cfg = scheduler_config(num_blocks, block_size=block_size, num_host_blocks=num_host_blocks, **kw)
    return Scheduler(cfg, eos_token_id=EOS), FakeWorker(
        block_size, num_blocks, eos_token_id=EOS, num_host_blocks=num_host_blocks
    )


def collect(got: dict, outs) -> None:
    for o in outs:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)


def test_swapped_request_resumes_with_its_kv_and_before_waiting_requests():
    # 9 usable blocks of 4 tokens; three 8-token prompts growing 8 tokens each cannot all fit.
    sched, worker = make(preemption_mode="swap")
    for rid in "abc":
        sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
        )
    c = sched.requests["c"]
    got: dict = {}
    while not sched.swapped:
        so, outs = step(sched, worker)
        collect(got, outs)
    assert so.preempted_req_ids == {"c"} and c.status == RequestStatus.PREEMPTED
    kept = c.num_computed_tokens
    host_ids = {b.block_id for b in sched.kv.req_to_host_blocks["c"]}
    assert kept > 8 and len(host_ids) == -(-kept // 4) and "c" not in sched.kv.req_to_blocks
    assert host_ids <= {h for _, h in so.blocks_to_swap_out}  # its KV went out this step; its progress stayed
    sched.add_request(EngineRequest(request_id="d", prompt_token_ids=[5] * 4, sampling_params=params(max_tokens=2)))
    while sched.swapped:
        so, outs = step(sched, worker)
        collect(got, outs)
        assert not (sched.swapped and so.scheduled_new_reqs)  # "d" waits while a swapped request is left
    i = so.scheduled_cached_reqs.req_ids.index("c")
    assert so.scheduled_cached_reqs.resumed_from_preemption[i]
    assert so.scheduled_cached_reqs.num_computed_tokens[i] == kept  # nothing recomputed
    assert {h for h, _ in so.blocks_to_swap_in} == host_ids
    assert so.num_scheduled_tokens["c"] == 1
    while sched.has_unfinished_requests():
        collect(got, step(sched, worker)[1])
    assert all(b.ref_cnt == 0 for b in sched.kv.host_pool.blocks) and not sched.kv.req_to_host_blocks

    roomy, roomy_worker = make(num_blocks=64, num_host_blocks=0)
    for rid, prompt, n in (("a", [97] * 8, 8), ("b", [98] * 8, 8), ("c", [99] * 8, 8), ("d", [5] * 4, 2)):
        roomy.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params(max_tokens=n)))
    assert got == {rid: tokens for (rid, _), (tokens, _) in run_all(roomy, roomy_worker).items()}


def test_host_tier_of_zero_never_swaps():
    sched, worker = make(num_host_blocks=0)
    for rid in "abc":
        sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
        )
    preempted = 0
    while sched.has_unfinished_requests():
        so, _ = step(sched, worker)
        preempted += len(so.preempted_req_ids)
        assert not so.blocks_to_swap_out and not so.blocks_to_swap_in and not sched.swapped
    assert preempted and sched.kv.host_pool is None


@pytest.mark.parametrize("swap_cost, swapped", [(0.1, True), (100.0, False)])
def test_auto_mode_swaps_only_when_copying_costs_less_than_recomputing(swap_cost, swapped):
    sched, worker = make(preemption_mode="auto", swap_cost_per_block=swap_cost, enable_prefix_caching=False)
    for rid in "abc":
        sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
        )
    while not sched.num_preemptions:
        step(sched, worker)
    assert bool(sched.swapped) == swapped
    assert (sched.requests["c"].num_computed_tokens > 0) == swapped


def test_full_host_tier_falls_back_to_recompute():
    sched, worker = make(num_host_blocks=2, preemption_mode="swap")  # one usable host block: c needs three
    for rid in "abc":
        sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
        )
    while not sched.num_preemptions:
        step(sched, worker)
    assert not sched.swapped and sched.requests["c"].status == RequestStatus.PREEMPTED
    assert sched.requests["c"].num_computed_tokens == 0 and sched.requests["c"] in sched.waiting
    run_all(sched, worker)


def test_abort_of_a_swapped_request_frees_its_host_blocks():
    sched, worker = make(preemption_mode="swap")
    for rid in "abc":
        sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[ord(rid)] * 8, sampling_params=params(max_tokens=8))
        )
    while not sched.swapped:
        step(sched, worker)
    (out,) = sched.abort("c")
    assert out.finish_reason == "abort" and not sched.swapped and not sched.kv.req_to_host_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.host_pool.blocks)
    run_all(sched, worker)


def test_evicted_prefix_comes_back_from_the_host_tier():
    sched, worker = make(num_blocks=8, num_host_blocks=16)  # 7 usable device blocks
    doc = list(range(10, 22))  # three full blocks
    sched.add_request(
        EngineRequest(request_id="first", prompt_token_ids=doc + [1], sampling_params=params(max_tokens=2))
    )
    run_all(sched, worker)
    for i in range(3):  # others pass through and evict the document's blocks from the device
        sched.add_request(
            EngineRequest(request_id=f"other{i}", prompt_token_ids=[30 + i] * 20, sampling_params=params(max_tokens=2))
        )
        run_all(sched, worker)
    hashes = sched.kv.block_pool.cached_blocks
    sched.add_request(
        EngineRequest(request_id="again", prompt_token_ids=doc + [2], sampling_params=params(max_tokens=2))
    )
    again = sched.requests["again"]
    assert not any(h in hashes for h in again.block_hashes[:3])  # gone from the device pool
    so, outs = step(sched, worker)
    assert len(so.blocks_to_swap_in) == 3 and so.scheduled_new_reqs[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens == {"again": 1}  # only the last token is computed
    assert len(outs) == 1  # the fake worker checked that every position it read holds the request's token
    stats = sched.stats()
    assert stats.host_prefix_cache_hits == 12 and stats.num_blocks_swapped_in == 3
    # the copied-back blocks are device cache entries again once the step returned
    assert all(sched.kv.block_pool.get_cached_block(h) is not None for h in again.block_hashes[:3])
    run_all(sched, worker)
