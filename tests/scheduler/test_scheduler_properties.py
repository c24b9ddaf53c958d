"""Random add / schedule / fake-output / abort histories must never corrupt the block pools.

Adds and aborts also land between ``schedule()`` and ``update_from_output()``,
as they do in the Ray actor while the workers run a step; some requests can
never fit, and some reuse an id that may still be live. With a host tier,
preemption swaps (mode swap or auto), evicted hashed blocks move to the host,
and prefix hits come back from it: both pools keep their invariants, and the
fake worker's copies show every hashed block holds exactly its tokens.

Steps in flight (as the Ray engine loop runs them): with async scheduling a
step is applied only after the next one was scheduled and run, so two steps
are in flight; with P pipeline stages, P steps. The same invariants hold,
and every request that ends by its stop rules got exactly the fake's
deterministic tokens, as a serial run gives. With P > 1 a second fake plays
a stage before the last: it never samples and takes each request's tokens
from the steps, so it fails if a token reaches it later than a step needs
it; no request is in two steps in flight that sample it.

With speculative decoding a proposer makes random proposals (often the fake's
own next tokens, often not) for the greedy requests; the fake accepts while a
proposal is its token, so acceptance is random too. Rejected tokens roll the
computed count back (the fake checks the count the scheduler sends), every
hashed block still holds exactly its tokens, and the outputs are the serial
run's. With a draft model the fake worker proposes instead (FakeWorker's
``draft_k``), and its draft writes KV past the computed tokens, into the
lookahead slots the scheduler gave it.
"""

import random
from collections import Counter, deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import EngineRequest, RequestStatus, SamplingParams, Scheduler
from scheduler.block_pool import BlockPool
from tests.scheduler.configs import scheduler_config
from tests.scheduler.fake_worker import FakeState, FakeWorker

BLOCK = 4
NUM_BLOCKS = 16  # 15 usable: 60 tokens
MAX_MODEL_LEN = 64
EOS = 3

# An id is fresh ("new"), an earlier caller's ("reuse"), or an earlier caller's first child id ("child").
caller_ids = st.tuples(st.sampled_from(["new", "new", "reuse", "child"]), st.integers(0, 5))
adds = st.tuples(
    st.just("add"),
    st.integers(0, 3),
    st.one_of(*[st.integers(1, 30)] * 5, st.just(MAX_MODEL_LEN)),  # sometimes too long for the model
    st.one_of(*[st.integers(1, 12)] * 5, st.just(60)),  # sometimes too many blocks for the pool
    st.integers(1, 3),
    st.integers(0, 2),
    caller_ids,
)
aborts = st.tuples(st.just("abort"), caller_ids)
steps = st.tuples(st.just("step"), st.lists(st.one_of(adds, aborts), max_size=2))
ops = st.one_of(adds, adds, aborts, steps, steps)


def check_pool(pool: BlockPool) -> None:
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


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    pool = kv.block_pool
    check_pool(pool)
    assert (
        not kv.held and not kv.blocks_to_swap_out and not kv.blocks_to_swap_in
    )  # a step's copies all went out with it
    host_refs = Counter(b.block_id for blocks in kv.req_to_host_blocks.values() for b in blocks)
    if kv.host_pool is not None:
        check_pool(kv.host_pool)
        for b in kv.host_pool.blocks[1:]:
            assert b.ref_cnt == host_refs[b.block_id], b
    assert not {r for r, b in kv.req_to_blocks.items() if b} & set(kv.req_to_host_blocks)  # one tier per request
    assert {r.request_id for r in sched.swapped} == set(kv.req_to_host_blocks)
    for r in sched.swapped:
        assert r.status == RequestStatus.PREEMPTED and r not in sched.waiting
        assert 0 < r.num_computed_tokens <= len(kv.req_to_host_blocks[r.request_id]) * BLOCK
    refs = Counter()
    for _rid, blocks in sched.kv.req_to_blocks.items():
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


def check_contents(sched: Scheduler, worker: FakeWorker, block_tokens: dict, requests: list) -> None:
    """Every hashed block, in either tier, holds exactly the tokens its hash names (after the step's copies).
    ``requests``: every request ever admitted, finished ones too (one that finishes may cache a block that its
    final token completed, in the same update)."""
    for r in requests:
        for i, h in enumerate(r.block_hashes):
            block_tokens[h] = r.all_token_ids[i * BLOCK : (i + 1) * BLOCK]
    tiers = [(sched.kv.block_pool, worker.kv), (sched.kv.host_pool, worker.host)]
    for pool, content in tiers:
        for b in pool.blocks[1:] if pool is not None else ():
            if b.block_hash is not None:
                assert content[b.block_id] == block_tokens[b.block_hash], (pool is sched.kv.host_pool, b)


class RandomProposer:
    """Up to max_k proposals, each the fake's next token with probability 0.7, else a random one."""

    def __init__(self, worker: FakeWorker, seed: int) -> None:
        self.worker, self.rng = worker, random.Random(seed)

    def propose(self, request, max_k: int) -> list[int]:
        assert max_k >= 1 and request.num_output_placeholders == 0
        out: list[int] = []
        for _ in range(self.rng.randint(0, max_k)):
            right = self.worker.next_token(request.request_id, FakeState(request.all_token_ids + out, [], 0))
            out.append(right if self.rng.random() < 0.7 else self.rng.randrange(50))
        return out


# host tier: (host blocks, preemption mode, swap cost per block); the first is today's engine
tiers = st.sampled_from(
    [
        (0, "auto", 1.0),
        (0, "recompute", 1.0),
        (6, "swap", 1.0),
        (24, "swap", 1.0),
        (24, "auto", 0.5),
        (24, "auto", 3.0),
        (24, "recompute", 1.0),
    ]
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(ops, min_size=15, max_size=60),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    threshold=st.sampled_from([0, 5]),
    tier=tiers,
    flight=st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 3), (1, 2)]),  # (steps in flight, pipeline stages)
    spec=st.sampled_from([0, 0, 3, 3]),  # proposed tokens per step at most
    draft=st.booleans(),  # proposals from a draft model on the (fake) ranks, else from the scheduler
    spec_seed=st.integers(0, 2**16),
)
def test_random_histories_keep_the_pool_consistent(
    history, policy, caching, threshold, tier, flight, spec, draft, spec_seed
):
    depth, pp = flight
    if spec:
        pp = 1  # speculation is refused with pipeline stages
    num_host_blocks, mode, swap_cost = tier
    cfg = scheduler_config(
        NUM_BLOCKS,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=caching,
        policy=policy,
        num_host_blocks=num_host_blocks,
        preemption_mode=mode,
        swap_cost_per_block=swap_cost,
        pipeline_parallel_size=pp,
        steps_in_flight=depth,
        num_speculative_tokens=spec,
        speculative_method="draft_model" if draft else "ngram",
    )
    sched = Scheduler(cfg, eos_token_id=EOS)
    worker = FakeWorker(
        BLOCK,
        NUM_BLOCKS,
        vocab_size=50,
        eos_token_id=EOS,
        eos_every=11,
        num_host_blocks=num_host_blocks,
        draft_k=spec if draft else 0,
        draft_seed=spec_seed,
    )
    if spec and not draft:
        sched.speculation.proposer = RandomProposer(worker, spec_seed)
    first_stage = FakeWorker(BLOCK, NUM_BLOCKS, num_host_blocks=num_host_blocks, samples=False) if pp > 1 else None
    block_tokens: dict = {}
    admitted: list = []
    prefixes = [[7] * 8, [9] * 8, [7] * 4 + [9] * 4, []]
    n_added = 0
    live: dict[str, set[int]] = {}  # caller id -> indexes of its samples not yet finished
    n_of: dict[str, int] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    shape: dict[str, tuple[int, int]] = {}  # caller id -> (prompt length, max_tokens)
    in_flight: deque = deque()

    def expected(rid: str, index: int) -> list[int]:
        """The fake's tokens for one sample run alone, serially, to its stop rules."""
        prompt_len, max_tokens = shape[rid]
        child = rid if n_of[rid] == 1 else f"{rid}#{index}"
        out: list[int] = []
        while True:
            out.append(worker.next_token(child, FakeState([0] * (prompt_len + len(out)), [], 0)))
            if out[-1] == EOS or len(out) >= max_tokens or prompt_len + len(out) >= MAX_MODEL_LEN:
                return out

    def live_request_ids() -> set[str]:
        return {c if n_of[c] == 1 else f"{c}#{i}" for c, indexes in live.items() for i in indexes}

    def note(outs):
        for o in outs:
            assert o.index in live[o.request_id], o  # each sample of a live caller, finished exactly once
            got = tokens.setdefault((o.request_id, o.index), [])
            got += o.new_token_ids
            if o.finished:
                del tokens[(o.request_id, o.index)]
                if o.finish_reason in ("stop", "length"):
                    assert got == expected(o.request_id, o.index), o
                live[o.request_id].remove(o.index)
                if not live[o.request_id]:
                    del live[o.request_id]

    def run(so):
        """Execute a step on the fakes (the last stage's output) and check what holds for steps in flight."""
        if first_stage is not None:
            step = sched.in_flight[so.step_id]
            for earlier_so, earlier in in_flight:
                # By object: a request aborted in flight and added again under its id is another request.
                earlier_step = sched.in_flight[earlier_so.step_id]
                both = set(step) & set(earlier.req_ids)
                assert not any(step[r] is earlier_step[r] for r in both), "two steps in flight sample it"
            first_stage.execute(so)
        out = worker.execute(so)
        if first_stage is not None:
            for rid in so.num_scheduled_tokens:
                n = worker.states[rid].num_computed_tokens
                assert first_stage.states[rid].token_ids[:n] == worker.states[rid].token_ids[:n], rid
        in_flight.append((so, out))

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
        # Odd ones greedy: with speculation on, they get proposals (a seeded sampled request never does).
        params = SamplingParams(max_tokens=max_tokens, n=n, seed=n_added, temperature=n_added % 2)
        ids = {rid} if n == 1 else {f"{rid}#{i}" for i in range(n)}
        if rid in live or ids & live_request_ids():
            with pytest.raises(ValueError, match="request_id"):
                sched.add_request(
                    EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params, priority=priority)
                )
            return
        live[rid], n_of[rid], shape[rid] = set(range(n)), n, (len(prompt), max_tokens)
        outs = sched.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params, priority=priority)
        )
        admitted.extend(sched.children.get(rid, ()))
        total = min(len(prompt) + max_tokens, MAX_MODEL_LEN)
        infeasible = len(prompt) >= MAX_MODEL_LEN or -(-total // BLOCK) > NUM_BLOCKS - 1
        assert len(outs) == (n if infeasible else 0)
        assert all(o.finished and o.finish_reason == "error" and o.error for o in outs)
        note(outs)

    for op in history:
        if op[0] == "step":
            so = sched.schedule()
            check_invariants(sched)
            run(so)
            for inner in op[1]:  # while the workers run the step
                apply(inner)
                check_invariants(sched)
            if len(in_flight) == depth:
                note(sched.update_from_output(*in_flight.popleft()))
        else:
            apply(op)
        check_invariants(sched)
        check_contents(sched, worker, block_tokens, admitted)

    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        run(so)
        if len(in_flight) == depth:
            note(sched.update_from_output(*in_flight.popleft()))
        check_invariants(sched)
        check_contents(sched, worker, block_tokens, admitted)
    while in_flight:
        note(sched.update_from_output(*in_flight.popleft()))
    assert not sched.has_unfinished_requests() and live == {} and sched.children == {} and sched.in_flight == {}
    assert all(b.ref_cnt == 0 for b in sched.kv.block_pool.blocks)
    assert sched.kv.req_to_blocks == {} and sched.kv.req_to_host_blocks == {} and sched.swapped == []
    if sched.kv.host_pool is not None:
        assert all(b.ref_cnt == 0 for b in sched.kv.host_pool.blocks)
    so = sched.schedule()
    for w in (worker, first_stage) if first_stage else (worker,):
        w.execute(so)
    assert worker.states == {}  # every request the workers held was reported finished
    assert first_stage is None or first_stage.states == {}
