"""The GPU decode figures, run on CPU: the timing loop measures only steps in which every request decodes, and
the HBM floor counts the bytes a step must read."""

import random

import pytest
import torch

from bench.throughput import decode_step_seconds, step_read_bytes
from engine.inprocess import InProcessEngine
from raylm import EngineConfig
from tests.workers.test_models import QWEN3_MOE
from workers.model_loader import load_model


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


def expected_reads(spec, batch: int, context: int, experts_touched: float | None = None) -> tuple[float, int]:
    """(weight bytes, KV bytes) a decode step reads, from the shapes (fp32): the layers, the final norm, the
    vocabulary table once as the head, and the step's embedding rows, whether the table is tied or not."""
    h, d, moe = spec.hidden_size, spec.head_dim, spec.moe
    attention = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    attention += 2 * d if spec.qk_norm else 0
    if moe is None:
        mlp = 3 * h * spec.intermediate_size
    else:
        mlp = moe.num_experts * h + experts_touched * 3 * h * moe.intermediate_size
    layers = spec.num_layers * (attention + mlp + 2 * h)
    weights = layers + h + spec.vocab_size * h + batch * h
    kv = batch * context * spec.num_layers * 2 * spec.num_kv_heads * d
    return 4 * weights, 4 * kv


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_reads_the_vocabulary_table_once_tied_or_not(tiny_model_dir, tied):
    path = tiny_model_dir("llama", tie_word_embeddings=tied)
    model = load_model(path)
    reads = step_read_bytes(model, batch=3, context=40, kv_dtype=torch.float32)
    assert (reads.weights, reads.kv) == expected_reads(model.spec, 3, 40)
    assert reads.experts == ""
    # Untied, the embedding table itself is not read: only the step's 3 rows.
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab_bytes = model.spec.vocab_size * model.spec.hidden_size * 4
    assert held - reads.weights == (vocab_bytes if not tied else 0) - 3 * model.spec.hidden_size * 4


@pytest.mark.parametrize(("batch", "touched"), [(1, 2.0), (3, 4.625), (16, 7.9198)])
def test_a_moe_decode_step_reads_the_experts_it_touches_on_average(tiny_model_dir, batch, touched):
    """8 experts, 2 a token picked as if at random: 8 * (1 - (6/8) ** batch) touched, 2 at one request and fewer
    than batch * 2 (6) at 3, where some tokens share an expert."""
    path = tiny_model_dir("qwen3_moe", **QWEN3_MOE)
    model = load_model(path)
    reads = step_read_bytes(model, batch=batch, context=9, kv_dtype=torch.bfloat16)
    weights, kv = expected_reads(model.spec, batch, 9, touched)
    assert reads.weights == pytest.approx(weights, abs=model.spec.num_layers)  # each layer's bytes rounded
    assert reads.kv == kv // 2  # a bf16 cache
    assert reads.experts == f"{touched:.1f} of 8 experts touched per MoE layer at {batch} x top-2"


def test_a_sliding_window_layer_reads_only_its_window(tiny_model_dir):
    model = load_model(tiny_model_dir("mistral", sliding_window=4))
    assert step_read_bytes(model, 2, 40, torch.float32).kv == expected_reads(model.spec, 2, 4)[1]
