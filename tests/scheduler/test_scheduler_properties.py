"""Random add / schedule / fake-output / abort histories must never corrupt the block pool.

Adds and aborts also land between ``schedule()`` and ``update_from_output()``,
as they do in the Ray actor while the workers run a step; some requests can
never fit, and some reuse an id that may still be live.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.fake_worker import FakeWorker

BLOCK = 4
NUM_BLOCKS = 16  # 15 usable: 60 tokens
MAX_MODEL_LEN = 64
EOS = 3

# An id is fresh ("new"), an earlier caller's ("reuse"), or an earlier caller's first child id ("child").
caller_ids = st.tuples(st.sampled_from(["new", "new", "reuse", "child"]), st.integers(0, 5))
adds = st.tuples(st.just("add"), st.integers(0, 3),
                 st.one_of(*[st.integers(1, 30)] * 5, st.just(MAX_MODEL_LEN)),  # sometimes too long for the model
                 st.one_of(*[st.integers(1, 12)] * 5, st.just(60)),  # sometimes too many blocks for the pool
                 st.integers(1, 3), st.integers(0, 2), caller_ids)
aborts = st.tuples(st.just("abort"), caller_ids)
steps = st.tuples(st.just("step"), st.lists(st.one_of(adds, aborts), max_size=2))
ops = st.one_of(adds, adds, aborts, steps, steps)


def check_invariants(sched: Scheduler) -> None:
    pool = sched.kv.block_pool
    free = {b.block_id for b in pool.free_queue}
    assert 0 not in free
    for b in pool.blocks[1:]:
        assert (b.ref_cnt == 0) == (b.block_id in free), b
        assert b.ref_cnt >= 0
        if b.block_hash is not None:
            assert pool.cached_blocks[b.block_hash][b.block_id] is b
    used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert pool.num_free_blocks == len(free) and len(free) + used == pool.num_blocks - 1
    for h, blocks in pool.cached_blocks.items():
        assert blocks
        for block_id, blk in blocks.items():
            assert blk.block_hash == h and pool.blocks[block_id] is blk
    refs = Counter()
    for rid, blocks in sched.kv.req_to_blocks.items():
        for b in blocks:
            refs[b.block_id] += 1
    for r in sched.running:
        assert len(sched.kv.req_to_blocks[r.request_id]) * BLOCK >= r.num_computed_tokens
    for block_id, count in refs.items():
        blk = pool.blocks[block_id]
        assert blk.ref_cnt == count
        if count > 1:
            assert blk.block_hash is not None, f"block {block_id} shared by {count} tables but not a full cached block"
    for r in sched.requests.values():
        if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            assert r.request_id not in sched.kv.req_to_blocks or not sched.kv.req_to_blocks[r.request_id]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.lists(ops, min_size=15, max_size=60), policy=st.sampled_from(["fcfs", "priority"]),
       caching=st.booleans(), threshold=st.sampled_from([0, 5]))
def test_random_histories_keep_the_pool_consistent(history, policy, caching, threshold):
    cfg = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, max_num_seqs=6,
                          max_num_batched_tokens=24, long_prefill_token_threshold=threshold,
                          enable_prefix_caching=caching, policy=policy)
    sched = Scheduler(cfg, eos_token_id=EOS)
    worker = FakeWorker(BLOCK, NUM_BLOCKS, vocab_size=50, eos_token_id=EOS, eos_every=11)
    prefixes = [[7] * 8, [9] * 8, [7] * 4 + [9] * 4, []]
    n_added = 0
    live: dict[str, set[int]] = {}  # caller id -> indexes of its samples not yet finished
    n_of: dict[str, int] = {}

    def live_request_ids() -> set[str]:
        return {c if n_of[c] == 1 else f"{c}#{i}" for c, indexes in live.items() for i in indexes}

    def note(outs):
        for o in outs:
            assert o.index in live[o.request_id], o  # each sample of a live caller, finished exactly once
            if o.finished:
                live[o.request_id].remove(o.index)
                if not live[o.request_id]:
                    del live[o.request_id]

    def caller_id(kind: str, k: int) -> str:
        return {"new": f"r{n_added}", "reuse": f"r{k}", "child": f"r{k}#0"}[kind]

    def apply(op):
        nonlocal n_added
        if op[0] == "abort":
            rid = caller_id(*op[1])
            expected = set(live.get(rid, ()))
            outs = sched.abort(rid)
            assert {(o.request_id, o.index) for o in outs} == {(rid, i) for i in expected}
            assert all(o.finish_reason == "abort" for o in outs)
            note(outs)
            return
        _, prefix, length, max_tokens, n, priority, who = op
        rid = caller_id(*who)
        n_added += 1
        prompt = prefixes[prefix] + [(n_added + i) % 50 for i in range(length)]
        params = SamplingParams(max_tokens=max_tokens, n=n, seed=n_added)
        ids = {rid} if n == 1 else {f"{rid}#{i}" for i in range(n)}
        if rid in live or ids & live_request_ids():
            with pytest.raises(ValueError, match="request_id"):
                sched.add_request(rid, prompt, params, priority=priority)
            return
        live[rid], n_of[rid] = set(range(n)), n
        outs = sched.add_request(rid, prompt, params, priority=priority)
        total = min(len(prompt) + max_tokens, MAX_MODEL_LEN)
        infeasible = len(prompt) >= MAX_MODEL_LEN or -(-total // BLOCK) > NUM_BLOCKS - 1
        assert len(outs) == (n if infeasible else 0)
        assert all(o.finished and o.finish_reason == "error" and o.error for o in outs)
        note(outs)

    for op in history:
        if op[0] == "step":
            so = sched.schedule()
            check_invariants(sched)
            runner_output = worker.execute(so)
            for inner in op[1]:  # while the workers run the step
                apply(inner)
                check_invariants(sched)
            note(sched.update_from_output(so, runner_output))
        else:
            apply(op)
        check_invariants(sched)

    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        note(sched.update_from_output(so, worker.execute(so)))
        check_invariants(sched)
    assert not sched.has_unfinished_requests() and live == {} and sched.children == {}
    assert all(b.ref_cnt == 0 for b in sched.kv.block_pool.blocks)
    assert sched.kv.req_to_blocks == {}
    so = sched.schedule()
    worker.execute(so)
    assert worker.states == {}  # every request the workers held was reported finished
