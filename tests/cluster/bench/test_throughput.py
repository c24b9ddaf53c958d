"""The GPU decode figures' timing loop, run on CPU: it measures only steps in which every request decodes."""

import random

from cluster import EngineConfig
from cluster.bench.throughput import decode_step_seconds
from cluster.engine.inprocess import InProcessEngine


def test_decode_steps_are_timed_when_the_batch_prefills_for_longer_than_it_decodes(tiny_model_dir):
    """16 prompts of 64 tokens at 32 tokens a step take about 64 steps to prefill, more than the 3 timed steps and
    their margin: the first requests must still be running when the last one starts decoding (a batch of 256 at
    512 tokens on a GPU's 2,048-token steps looped for ever)."""
    config = EngineConfig(
        model=tiny_model_dir("llama"), device="cpu", max_num_batched_tokens=32, max_num_seqs=16, kv_cache_bytes=8 << 20
    )
    engine = InProcessEngine(config)
    assert decode_step_seconds(engine, batch=16, context=64, steps=3, rng=random.Random(0)) > 0
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.block_pool.num_free_blocks == engine.num_blocks - 1
