"""The CacheEngine's host tier: whole blocks, every layer, copied out and back bit for bit, in the step's order."""

import pytest
import torch

from workers.cache_engine import CacheEngine, block_runs, check_swap_space, host_memory_available, pinned_bytes


def engine(num_host_blocks=6, dtype=torch.bfloat16) -> CacheEngine:
    cache = CacheEngine(
        num_layers=3,
        num_blocks=8,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        device=torch.device("cpu"),
        num_host_blocks=num_host_blocks,
    )
    cache.kv_cache.copy_(torch.randn(cache.kv_cache.shape).to(dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kv_bytes_identical_after_a_round_trip(dtype):
    cache = engine(dtype=dtype)
    original = cache.kv_cache.clone()
    cache.swap([(3, 1), (5, 4), (6, 2)], [])
    assert cache.host_cache.shape == (2, 3, 6, 4, 2, 8) and cache.host_cache.dtype == dtype
    cache.kv_cache.zero_()
    cache.swap([], [(4, 2), (1, 7), (2, 3)])  # back into other device blocks
    for dev, orig in ((2, 5), (7, 3), (3, 6)):
        assert torch.equal(cache.kv_cache[:, :, dev].view(torch.uint8), original[:, :, orig].view(torch.uint8))
    assert not cache.kv_cache[:, :, [0, 1, 4, 5, 6]].view(torch.uint8).any()  # nothing else was written


def test_swap_out_reads_a_block_before_the_same_steps_swap_in_overwrites_it():
    cache = engine()
    original = cache.kv_cache.clone()
    # Block 3 leaves for host block 1 while host block 2's content (from an earlier step) arrives in it.
    cache.swap([(5, 2)], [])
    cache.swap([(3, 1)], [(2, 3)])
    assert torch.equal(cache.host_cache[:, :, 1], original[:, :, 3])
    assert torch.equal(cache.kv_cache[:, :, 3], original[:, :, 5])


def test_swap_space_larger_than_the_host_is_refused_naming_the_memory():
    check_swap_space(1 << 20)
    with pytest.raises(
        ValueError,
        match=r"swap_space_bytes=\d+ takes \d+ bytes: more than this host can give, "
        r"\d+ bytes",
    ):
        check_swap_space(host_memory_available() * 2)


@pytest.mark.parametrize(
    "nbytes,pinned", [(0, 0), (1, 1), (4096, 4096), (4097, 8192), (40 << 30, 64 << 30), ((1 << 30) + 1, 2 << 30)]
)
def test_pinned_size_is_the_next_power_of_two(nbytes, pinned):
    assert pinned_bytes(nbytes) == pinned


def test_a_pinned_tier_that_fits_only_unrounded_is_refused_naming_both_sizes():
    swap, available = (40 << 30), (48 << 30)
    check_swap_space(swap, available=available)  # unpinned (CPU): 40 GiB of 48 fits
    with pytest.raises(ValueError, match=rf"swap_space_bytes={swap} pins {64 << 30} bytes .* {available} bytes"):
        check_swap_space(swap, pinned=True, available=available)


def test_every_rank_on_a_host_pins_its_own_tier():
    check_swap_space(3 << 30, pinned=True, ranks_on_host=2, available=9 << 30)  # 2 x 4 GiB of 9
    with pytest.raises(ValueError, match=r"on each of 3 ranks"):
        check_swap_space(3 << 30, pinned=True, ranks_on_host=3, available=9 << 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_blocks_read_in_any_order_are_written_elsewhere_bit_for_bit(dtype):
    source, target = engine(0, dtype), engine(0, dtype)
    blocks = source.read_blocks([5, 6, 2, 3, 7])  # runs 5-6, 2-3 and 7
    assert blocks.shape == (2, 3, 5, 4, 2, 8 * torch.finfo(dtype).bits // 8)
    target.write_blocks([1, 4, 5, 6, 0], blocks)
    for src, dst in zip([5, 6, 2, 3, 7], [1, 4, 5, 6, 0]):
        assert torch.equal(target.kv_cache[:, :, dst].view(torch.uint8), source.kv_cache[:, :, src].view(torch.uint8))


def test_blocks_of_another_shape_are_refused_naming_both():
    blocks = engine(0).read_blocks([1, 2])
    with pytest.raises(
        ValueError, match=r"\(2, 3, 2, 4, 1, 16\) \(bytes\) do not fit 2 blocks of this cache, \(2, 3, 2, 4, 2, 16\)"
    ):
        engine(0).write_blocks([3, 4], blocks[:, :, :, :, :1])


def test_block_runs_group_pairs_whose_ids_both_go_up_by_one():
    assert block_runs([4, 5, 6, 1, 9, 10], [0, 1, 7, 8, 9, 10]) == [(4, 0, 2), (6, 7, 1), (1, 8, 1), (9, 9, 2)]
