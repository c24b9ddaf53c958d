"""KV-cache events: each step's events, replayed in order over what each tier's cache held before the step, store
every hash that entered it once and remove every hash that left it once, giving exactly what it holds after; a
device-tier BlockStored carries the tokens its hashes chain over."""

import random

from scheduler import EngineRequest, Scheduler
from scheduler.block_hash import hash_block_tokens
from scheduler.kv_events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from tests.scheduler.configs import scheduler_config
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.test_scheduler import EOS, params, step

BLOCK = 4


def replay(held: dict[str, set], events: list) -> None:
    """Apply events to each tier's set of hashes, failing on a hash stored twice or removed while absent."""
    for event in events:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                assert h not in held[event.medium], "a hash stored twice"
                held[event.medium].add(h)
        else:
            for h in event.block_hashes:
                assert h in held[event.medium], "a hash removed that was not stored"
                held[event.medium].remove(h)


def check_chain(event: BlockStored) -> None:
    if event.medium == HOST:
        assert event.parent_block_hash is None and event.token_ids == []
        return
    assert len(event.token_ids) == BLOCK * len(event.block_hashes)
    parent = event.parent_block_hash
    for i, h in enumerate(event.block_hashes):
        parent = hash_block_tokens(parent, event.token_ids[i * BLOCK : (i + 1) * BLOCK])
        assert parent == h


def test_each_steps_events_replay_to_what_each_tier_holds():
    cfg = scheduler_config(14, block_size=BLOCK, num_host_blocks=10, enable_kv_cache_events=True)
    sched = Scheduler(cfg, eos_token_id=EOS)
    worker = FakeWorker(BLOCK, 14, eos_token_id=EOS, num_host_blocks=10)
    pools = {DEVICE: sched.kv.block_pool, HOST: sched.kv.host_pool}
    rng = random.Random(7)
    heads = [[rng.randrange(3, 50) for _ in range(8)] for _ in range(3)]
    # Two equal prompts arrive together: computed side by side, the second's blocks repeat the first's hashes.
    prompts = [heads[0] + [7, 8, 9]] * 2
    prompts += [rng.choice(heads) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))] for _ in range(14)]
    first = sched.kv.take_events()
    assert [type(e) for e in first] == [AllBlocksCleared]
    held: dict[str, set] = {DEVICE: set(), HOST: set()}
    kinds: set = set()
    for i, prompt in enumerate(prompts):
        request = EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params(max_tokens=6))
        sched.add_request(request)
        if i % 2 == 0:
            continue  # two requests, then three steps
        for _ in range(3):
            step(sched, worker)
            events = sched.kv.take_events()
            replay(held, events)
            assert {m: set(pool.cached_blocks) for m, pool in pools.items()} == held
            for event in events:
                kinds.add((type(event), event.medium))
                if isinstance(event, BlockStored):
                    check_chain(event)
    while sched.has_unfinished_requests():
        step(sched, worker)
        replay(held, sched.kv.take_events())
    assert {m: set(pool.cached_blocks) for m, pool in pools.items()} == held
    assert kinds == {(BlockStored, DEVICE), (BlockRemoved, DEVICE), (BlockStored, HOST), (BlockRemoved, HOST)}


def test_events_off_collect_nothing():
    sched = Scheduler(scheduler_config(14, block_size=BLOCK), eos_token_id=EOS)
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=[5] * 9, sampling_params=params()))
    step(sched, FakeWorker(BLOCK, 14, eos_token_id=EOS))
    assert sched.kv.block_pool.cached_blocks and sched.kv.events is None and sched.kv.take_events() == []
