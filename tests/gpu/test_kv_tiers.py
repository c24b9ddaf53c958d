"""The host tier on CUDA: a pinned host tensor, blocks copied out and back bit for bit, and an engine whose
prefix hits come back from host memory giving the same greedy tokens."""

import torch

from tests.gpu.test_engine import cuda_engine, greedy
from tests.workers.test_model_runner import prompts, run
from workers.cache_engine import CacheEngine


def test_kv_bytes_identical_after_a_round_trip_through_pinned_memory():
    cache = CacheEngine(
        num_layers=3,
        num_blocks=8,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
        num_host_blocks=6,
    )
    assert cache.host_cache.is_pinned() and cache.host_cache.device.type == "cpu"
    cache.kv_cache.copy_(torch.randn(cache.kv_cache.shape, device="cuda").to(torch.bfloat16))
    original = cache.kv_cache.clone()
    cache.swap([(3, 1), (5, 4)], [])
    cache.kv_cache.zero_()
    cache.swap([(2, 0)], [(4, 2), (1, 7)])  # device block 2 goes out (zeros) before block 2 is written
    torch.cuda.synchronize()
    assert torch.equal(cache.kv_cache[:, :, 2].view(torch.uint8), original[:, :, 5].view(torch.uint8))
    assert torch.equal(cache.kv_cache[:, :, 7].view(torch.uint8), original[:, :, 3].view(torch.uint8))
    assert not cache.host_cache[:, :, 0].any()


def test_prefix_hits_from_the_host_tier_give_the_same_greedy_tokens(tiny_model_dir):
    engine = cuda_engine(tiny_model_dir("llama"), dtype="float32", swap_space=1 / 16)
    ids = prompts(6)
    params = greedy(6, 8)
    expected = run(engine, ids, params)
    # Evict every cached device block (as later requests would): each one's content moves to a host block.
    kv = engine.scheduler.kv
    taken = kv._get_device_blocks(kv.block_pool.num_free_blocks)
    kv.block_pool.free_blocks(taken)
    assert not kv.block_pool.cached_blocks and kv.host_pool.cached_blocks
    assert run(engine, ids, params) == expected
    stats = engine.stats()
    assert stats.host_prefix_cache_hits > 0 and stats.num_blocks_swapped_in > 0
