"""A rank asleep (Worker.sleep / wake_up, workers/sleep.py): its memory really goes back to the system, and what
wakes is what slept (level 1) or the checkpoint, but for what an update wrote meanwhile (level 2)."""

import os

import pytest
import torch

from tests.workers.configs import worker_config
from tests.workers.test_weight_update import EMBED, Q, assert_same, params
from workers.model_loader import load_model
from workers.worker import Worker

KV_BYTES = 32 << 20
# Large enough that RSS tells (48 MB of weights, as much again packed), small enough to load at once; its tensors (at
# most 16 MB) live in glibc's heap, which only malloc_trim gives back.
MID_SIZE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=16384)


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cached_worker(path: str, kv_bytes: int = 1 << 20) -> Worker:
    worker = Worker(worker_config(path, 256, kv_cache_bytes=kv_bytes))
    worker.init_device()
    worker.load_model()
    worker.init_cache(worker.determine_num_blocks())
    return worker


def assert_cache_bound(worker: Worker, num_blocks: int) -> None:
    kv = worker.cache.kv_cache
    assert kv.shape[2] == num_blocks and not kv.any()
    for i, layer in enumerate(worker.model.attention_layers):
        assert layer.kv_cache.data_ptr() == kv[:, i].data_ptr()


def test_sleep_gives_the_memory_back_and_wake_brings_it_back(tiny_model_dir):
    worker = cached_worker(tiny_model_dir("llama", **MID_SIZE), KV_BYTES)
    blocks = worker.cache.num_blocks
    kv_bytes = worker.cache.kv_cache.nbytes
    weight_bytes = sum(p.nbytes for p in worker.model.parameters())
    before = params(worker.model)
    worker.cache.kv_cache.fill_(1.0)
    start = rss()
    worker.sleep(1)
    assert worker.is_sleeping() and start - rss() > 0.8 * kv_bytes
    worker.wake_up()
    assert not worker.is_sleeping()
    assert_same(worker.model, before)  # on CPU the weights stayed
    assert_cache_bound(worker, blocks)
    start = rss()
    worker.sleep(2)
    # The plain weights and their packed copies (as large again, bar the norms) went with the cache.
    assert start - rss() > 0.8 * (kv_bytes + weight_bytes)
    worker.wake_up(["weights"])
    worker.wake_up(["kv_cache"])
    assert_same(worker.model, before)  # read back from the checkpoint
    assert_cache_bound(worker, blocks)


def test_after_level_2_an_update_is_kept_and_the_rest_read_back(tiny_model_dir):
    path = tiny_model_dir("llama", tie_word_embeddings=True)
    worker = cached_worker(path)
    worker.sleep(2)
    with pytest.raises(ValueError, match="while they sleep"):
        worker.update_weights([(Q, torch.ones(64, 64))])
    worker.wake_up(["weights"])
    worker.update_weights([(Q, torch.ones(64, 64)), (EMBED, torch.ones(256, 64))])
    assert worker.is_sleeping()
    worker.wake_up(["kv_cache"])
    expected = params(load_model(path))
    expected[EMBED] = torch.ones(256, 64)
    expected["model.layers.0.self_attn.qkv_proj.weight"][:64] = 1.0  # q_proj's rows; k and v from the checkpoint
    assert_same(worker.model, expected)
    assert torch.equal(worker.model.compute_logits(torch.ones(9, 64)), torch.full((9, 256), 64.0))  # packed head


def test_levels_and_tags_are_checked(tiny_model_dir):
    worker = cached_worker(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        worker.sleep(3)
    worker.sleep(1)
    with pytest.raises(ValueError, match="unknown wake_up tag 'kv'"):
        worker.wake_up(["kv"])
    assert worker.is_sleeping()
    worker.wake_up(["kv_cache"])
    assert not worker.is_sleeping()
