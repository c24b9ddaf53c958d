"""Random add / schedule / fake-output / abort histories must never corrupt the block pool."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from tests.scheduler.fake_worker import FakeWorker

BLOCK = 4
NUM_BLOCKS = 16
EOS = 3

ops = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30), st.integers(1, 12), st.integers(1, 3),
              st.integers(0, 2)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


def check_invariants(sched: Scheduler) -> None:
    pool = sched.kv.block_pool
    free = {b.block_id for b in pool.free_queue}
    assert 0 not in free
    for b in pool.blocks[1:]:
        assert (b.ref_cnt == 0) == (b.block_id in free), b
        assert b.ref_cnt >= 0
    used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert pool.num_free_blocks == len(free) and len(free) + used == pool.num_blocks - 1
    for h, blocks in pool.cached_blocks.items():
        for blk in blocks.values():
            assert blk.block_hash == h
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
@given(history=st.lists(ops, min_size=1, max_size=60), policy=st.sampled_from(["fcfs", "priority"]),
       caching=st.booleans(), threshold=st.sampled_from([0, 5]))
def test_random_histories_keep_the_pool_consistent(history, policy, caching, threshold):
    cfg = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=48, max_num_seqs=6,
                          max_num_batched_tokens=24, long_prefill_token_threshold=threshold,
                          enable_prefix_caching=caching, policy=policy)
    sched = Scheduler(cfg, eos_token_id=EOS)
    worker = FakeWorker(BLOCK, NUM_BLOCKS, vocab_size=50, eos_token_id=EOS, eos_every=11)
    prefixes = [[7] * 8, [9] * 8, [7] * 4 + [9] * 4, []]
    n_added = 0
    finished_callers: Counter = Counter()

    def note(outs):
        for o in outs:
            if o.finished:
                finished_callers[o.request_id] += 1

    for op in history:
        if op[0] == "add":
            _, prefix, length, max_tokens, n, priority = op
            prompt = prefixes[prefix] + [(n_added + i) % 50 for i in range(length)]
            note(sched.add_request(f"r{n_added}", prompt, SamplingParams(max_tokens=max_tokens, n=n, seed=n_added),
                                   priority=priority))
            n_added += 1
        elif op[0] == "abort":
            note(sched.abort(f"r{op[1]}"))
        else:
            so = sched.schedule()
            note(sched.update_from_output(so, worker.execute(so)))
        check_invariants(sched)

    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        note(sched.update_from_output(so, worker.execute(so)))
        check_invariants(sched)
    assert not sched.has_unfinished_requests()
    assert all(b.ref_cnt == 0 for b in sched.kv.block_pool.blocks)
    assert sched.kv.req_to_blocks == {}
    so = sched.schedule()
    worker.execute(so)
    assert worker.states == {}  # every request the workers held was reported finished
    # every sample of every accepted request was finished exactly once
    assert sum(finished_callers.values()) == sum(
        1 for o in history if o[0] == "add" for _ in range(o[4]))
