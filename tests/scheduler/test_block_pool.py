import pytest

from scheduler.block_hash import hash_block_tokens
from scheduler.block_pool import BlockPool
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import EngineRequest, Request


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_free_queue_and_eviction_order_after_scripted_sequence():
    pool = BlockPool(6)
    assert free_ids(pool) == [1, 2, 3, 4, 5]  # the null block 0 is never free

    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    assert free_ids(pool) == [4, 5]

    h1 = hash_block_tokens(None, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    pool.cache_full_blocks(a, [h1, h2], 0, 2)
    pool.free_blocks(reversed(a))  # a request's blocks are freed tail first
    assert free_ids(pool) == [4, 5, 3, 2, 1]

    assert pool.get_cached_block(h1) is a[0]
    pool.touch([a[0]])  # a prefix hit pulls block 1 out of the middle of the queue
    assert free_ids(pool) == [4, 5, 3, 2]
    assert a[0].ref_cnt == 1

    b = pool.get_new_blocks(3)
    assert [x.block_id for x in b] == [4, 5, 3]
    assert pool.get_cached_block(h2) is a[1]  # still cached while it waits in the queue

    c = pool.get_new_blocks(1)  # LRU: block 2 is now the head and its cache entry is evicted
    assert c[0].block_id == 2 and c[0].block_hash is None
    assert pool.get_cached_block(h2) is None
    assert pool.get_cached_block(h1) is a[0]
    assert free_ids(pool) == []

    pool.free_blocks([a[0]])
    pool.free_blocks(b)
    assert free_ids(pool) == [1, 4, 5, 3]


def test_pool_refuses_more_blocks_than_free():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1)


def test_touch_and_free_keep_ref_counts_under_sharing():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    pool.touch([blk])
    assert blk.ref_cnt == 3 and 1 not in free_ids(pool)
    pool.free_blocks([blk])
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and 1 not in free_ids(pool)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool)[-1] == 1


def test_hash_chain_depends_on_prefix_and_salt():
    h_a = hash_block_tokens(None, [1, 2, 3, 4])
    h_b = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(h_a, [5, 6, 7, 8]) != hash_block_tokens(h_b, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], "salt") != h_a
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h_a


def test_request_extends_block_hashes_incrementally_for_full_blocks_only():
    r = Request(EngineRequest(request_id="r", prompt_token_ids=list(range(10))), block_size=4)
    assert len(r.block_hashes) == 2  # 10 tokens: two full blocks, the third is open
    r.append_output_token(10)
    assert len(r.block_hashes) == 2
    r.append_output_token(11)
    assert len(r.block_hashes) == 3
    whole = Request(EngineRequest(request_id="w", prompt_token_ids=list(range(12))), block_size=4)
    assert whole.block_hashes == r.block_hashes  # incremental == from scratch


def make_manager(num_blocks=10, block_size=4, caching=True):
    return KVCacheManager(num_blocks, block_size, caching)


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """Allocate and 'compute' n tokens, as scheduler + worker + update_from_output would."""
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def test_prefix_hits_across_requests_sharing_a_prompt():
    kv = make_manager()
    a = Request(EngineRequest(request_id="a", prompt_token_ids=list(range(10))), block_size=4)
    compute(kv, a, 10)
    b = Request(EngineRequest(request_id="b", prompt_token_ids=list(range(8)) + [50, 51, 52]), block_size=4)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == kv.req_to_blocks["a"][:2]
    assert kv.allocate_slots(b, 3, n, hits) is not None
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    assert kv.req_to_blocks["b"][:2] == hits
    kv.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert kv.prefix_cache_queries == 0  # a lookup alone is not an admission
    kv.record_prefix_lookup(b, n)
    assert kv.prefix_cache_queries == 11 and kv.prefix_cache_hits == 8


def test_manager_frees_a_requests_blocks_tail_first():
    kv = make_manager(num_blocks=6, block_size=4)
    a = Request(EngineRequest(request_id="a", prompt_token_ids=list(range(12))), block_size=4)
    assert [b.block_id for b in kv.allocate_slots(a, 12)] == [1, 2, 3]
    kv.free(a)
    # The prompt head goes last, so it outlives the tail in the prefix cache.
    assert free_ids(kv.block_pool) == [4, 5, 3, 2, 1]


def test_no_hit_for_equal_blocks_after_different_prefixes():
    kv = make_manager()
    a = Request(EngineRequest(request_id="a", prompt_token_ids=[1, 1, 1, 1, 5, 6, 7, 8, 0]), block_size=4)
    compute(kv, a, 9)
    b = Request(EngineRequest(request_id="b", prompt_token_ids=[2, 2, 2, 2, 5, 6, 7, 8, 0]), block_size=4)
    assert kv.get_computed_blocks(b) == ([], 0)


def test_hit_is_capped_so_the_last_token_is_computed():
    kv = make_manager()
    a = Request(EngineRequest(request_id="a", prompt_token_ids=list(range(8))), block_size=4)
    compute(kv, a, 8)
    same = Request(EngineRequest(request_id="same", prompt_token_ids=list(range(8))), block_size=4)
    hits, n = kv.get_computed_blocks(same)
    assert n == 4 and len(hits) == 1


def test_blocks_are_cached_only_once_computed():
    kv = make_manager()
    a = Request(EngineRequest(request_id="a", prompt_token_ids=list(range(8))), block_size=4)
    assert kv.allocate_slots(a, 8) is not None  # scheduled, not yet computed
    b = Request(EngineRequest(request_id="b", prompt_token_ids=list(range(8)) + [9]), block_size=4)
    assert kv.get_computed_blocks(b) == ([], 0)


def test_allocate_returns_none_without_side_effects_when_full():
    kv = make_manager(num_blocks=4, block_size=4)
    a = Request(EngineRequest(request_id="a", prompt_token_ids=list(range(12))), block_size=4)
    assert len(kv.allocate_slots(a, 12)) == 3
    b = Request(EngineRequest(request_id="b", prompt_token_ids=[1, 2]), block_size=4)
    assert kv.allocate_slots(b, 2) is None
    assert kv.block_pool.num_free_blocks == 0
    assert kv.req_to_blocks["b"] == []
    assert kv.allocate_slots(a, 0) == []  # no growth: the decode fast path
