"""A rank's start-up decisions, checked on CPU: its dtype, its GPU, and how large its KV cache may be."""

import dataclasses
import json

import pytest
import torch

from tests.workers.configs import worker_config
from workers.memory import MemoryProfile, MemorySnapshot, graph_pool_bytes, kv_cache_budget, profile_peak
from workers.worker import Worker, cuda_index, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
GiB = 1 << 30


@pytest.mark.parametrize(
    "checkpoint,bf16_supported,expected",
    [
        (torch.bfloat16, True, torch.bfloat16),
        (torch.float16, True, torch.float16),
        (torch.float32, True, torch.bfloat16),  # an fp32 checkpoint runs in half precision on a GPU
        (None, True, torch.bfloat16),  # config.json records no dtype
        (torch.float32, False, torch.float16),  # pre-Ampere GPUs have no bf16
        (torch.bfloat16, False, torch.float16),
    ],
)
def test_auto_dtype_on_cuda_is_the_checkpoints_half_dtype(checkpoint, bf16_supported, expected):
    assert resolve_dtype("auto", checkpoint, CUDA, bf16_supported) == expected


@pytest.mark.parametrize("checkpoint", [torch.bfloat16, torch.float16, torch.float32, None])
def test_auto_dtype_on_cpu_is_fp32_and_a_named_dtype_is_kept(checkpoint):
    assert resolve_dtype("auto", checkpoint, CPU) == torch.float32
    assert resolve_dtype("float16", checkpoint, CPU) == torch.float16
    assert resolve_dtype("float32", checkpoint, CUDA) == torch.float32


def test_worker_runs_a_bf16_checkpoint_in_fp32_on_cpu(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.bfloat16).save_pretrained(tmp_path)
    worker = Worker(worker_config(str(tmp_path)))
    worker.init_device()
    worker.load_model()
    assert worker.spec.dtype == torch.bfloat16
    assert worker.dtype == torch.float32 and worker.model.lm_head.weight.dtype == torch.float32


# Ray's GPU ids under both settings of RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, on a node of 4 GPUs.
@pytest.mark.parametrize(
    "gpu_ids,visible,expected",
    [
        ([2], "2", 0),  # unset: Ray masks the actor to its GPU
        ([3], "3", 0),
        ([2], None, 2),  # set, and nobody masks: every GPU is visible
        ([3], None, 3),
        ([3], "0,1,2,3", 3),  # set, the operator's list
        ([3], "3,2,1,0", 0),
        ([1], "0,1", 1),  # the engine's default: every rank sees its node's GPUs (share_node_gpus)
        ([2], "2,3", 0),
        (["GPU-b1"], "GPU-a0,GPU-b1", 1),  # UUIDs, as some clusters list them
        ([], None, 0),  # no Ray: the first GPU
    ],
)
def test_cuda_index_follows_rays_gpu_ids(gpu_ids, visible, expected):
    assert cuda_index(gpu_ids, visible) == expected


def test_cuda_index_refuses_a_gpu_it_cannot_see():
    with pytest.raises(ValueError, match="does not list it"):
        cuda_index([5], "0,1")


def test_budget_takes_out_the_profile_peak_and_memory_outside_torch():
    total = 80 * GiB
    # Before: weights and context (20 GiB in use, 16 of them torch's); after: NCCL took 1 GiB outside torch.
    before = MemorySnapshot(used=20 * GiB, torch_reserved=16 * GiB)
    after = MemorySnapshot(used=21 * GiB + 512 * 2**20, torch_reserved=16 * GiB + 512 * 2**20)
    budget = kv_cache_budget(total, 0.9, before, after, profile_peak=6 * GiB)
    assert budget == int(72 * GiB) - 20 * GiB - 6 * GiB - 1 * GiB
    # Memory torch kept (the profile's persistent state) is not growth outside torch.
    same = MemorySnapshot(used=21 * GiB, torch_reserved=17 * GiB)
    assert kv_cache_budget(total, 0.9, before, same, 6 * GiB) == int(72 * GiB) - 26 * GiB
    # Memory outside torch that shrank (another process left) is not a credit.
    shrunk = MemorySnapshot(used=18 * GiB, torch_reserved=16 * GiB)
    assert kv_cache_budget(total, 0.9, before, shrunk, 6 * GiB) == int(72 * GiB) - 26 * GiB
    # The CUDA graphs' pool, captured after the cache is sized, comes out of the budget too.
    assert kv_cache_budget(total, 0.9, before, same, 6 * GiB, graph_pool=GiB) == int(72 * GiB) - 27 * GiB


def test_profile_peak_counts_what_the_allocator_reserved_beyond_the_tensors():
    # Tensors peaked 6 GiB over the start; fragmentation made the allocator reserve 7.5 GiB for them.
    assert profile_peak(10 * GiB, 16 * GiB, 10 * GiB, 17 * GiB + GiB // 2) == 7 * GiB + GiB // 2
    # Reserved memory the start already held (cached blocks reused by the profile) is not counted twice.
    assert profile_peak(10 * GiB, 16 * GiB, 14 * GiB, 17 * GiB) == 6 * GiB


@pytest.mark.parametrize(
    "forward_peak,tokens,max_graph,expected",
    [
        (4 * GiB, 2048, 512, GiB),  # the largest graph decodes 512 tokens of the profile's 2048
        (4 * GiB, 2048, 0, 0),  # no graphs (eager, CPU, or a backend that cannot be captured)
        (4 * GiB, 256, 512, 4 * GiB),  # never more than the profile's own forward
    ],
)
def test_graph_pool_is_the_largest_graphs_share_of_the_forward_peak(forward_peak, tokens, max_graph, expected):
    assert graph_pool_bytes(forward_peak, tokens, max_graph) == expected


def drafting_worker(path: str) -> Worker:
    """A worker on CPU whose target is its own draft (k = 3), 8 requests of up to 64 tokens a step."""
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    config = worker_config(path, 64, max_num_seqs=8, max_num_batched_tokens=64, speculative_config=json.dumps(spec))
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    return worker


def test_the_drafts_graph_pool_comes_out_of_the_kv_budget(tiny_model_dir, monkeypatch):
    """The draft's graphs have a pool of their own at the target's shapes, 8 requests verifying 3 proposals (32
    tokens) the largest: with them on, a GPU rank holds that pool's bytes fewer of KV, the pool scaled from the
    draft's forward peak over the profile's 64 tokens as the target's is from its own."""
    worker = drafting_worker(tiny_model_dir("llama"))
    worker.runner.decode_graphs.sizes = [1, 2, 4, 8]
    worker.device = CUDA  # the budget's arithmetic on a profile's figures (the profile itself needs a GPU)
    used = MemorySnapshot(used=10 * GiB, torch_reserved=8 * GiB)
    profile = MemoryProfile(80 * GiB, used, used, peak=6 * GiB, forward_peak=4 * GiB, draft_forward_peak=GiB)
    monkeypatch.setattr(worker, "_profile_memory", lambda: profile)
    utilization = worker.config.gpu_memory_utilization
    budget = kv_cache_budget(80 * GiB, utilization, used, used, 6 * GiB, graph_pool=2 * GiB)  # the target's: 32/64 of 4
    assert worker.determine_num_blocks() == budget // worker.block_bytes()  # the draft eager: no pool of its own
    worker.draft.graphs.sizes = [1, 2, 4, 8]
    assert worker.determine_num_blocks() == (budget - GiB // 2) // worker.block_bytes()


def test_the_profile_runs_the_draft_on_a_throwaway_cache_and_keeps_the_larger_peak(tiny_model_dir, monkeypatch):
    """The profile's sequence on CPU, CUDA's counters faked: the target's step, then the draft's forward over its
    tokens on a cache of its own; the step's peak is the larger of the two, and both caches are let go."""
    worker = drafting_worker(tiny_model_dir("llama"))
    peaks = iter([6 * GiB, 7 * GiB])  # the target's step, then the draft's forward
    fake = {
        "empty_cache": lambda: None,
        "mem_get_info": lambda: (70 * GiB, 80 * GiB),
        "memory_allocated": lambda: 0,
        "memory_reserved": lambda: 0,
        "reset_peak_memory_stats": lambda: None,
        "synchronize": lambda: None,
        "max_memory_allocated": lambda: next(peaks),
        "max_memory_reserved": lambda: 0,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    forward = worker.draft.model.forward
    drafted = []
    monkeypatch.setattr(
        worker.draft.model, "forward", lambda ids, *rest: drafted.append(len(ids)) or forward(ids, *rest)
    )
    profile = worker._profile_memory()
    assert drafted == [64] and profile.peak == 7 * GiB and profile.total == 80 * GiB
    assert worker.draft.cache is None
    layers = worker.model.attention_layers + worker.draft.model.attention_layers
    assert all(layer.kv_cache.numel() == 0 for layer in layers)


def test_profile_runs_the_sampler_at_full_width_with_every_feature(tiny_model_dir):
    worker = Worker(worker_config(tiny_model_dir("llama"), 64, max_num_seqs=96, max_num_batched_tokens=80))
    worker.init_device()
    worker.load_model()
    cache = worker._new_cache(worker._profile_blocks())
    cache.bind(worker.model.attention_layers)
    seen = {}
    sampler = worker.runner.sampler

    def spy(logits, md):
        seen["rows"], seen["md"] = logits.shape[0], md
        return sampler(logits, md)

    worker.runner.sampler = spy
    logits_rows = []
    compute_logits = worker.model.compute_logits
    worker.model.compute_logits = lambda hidden: logits_rows.append(hidden.shape[0]) or compute_logits(hidden)
    assert worker.profile_forward() == 0  # the forward's own peak is measured on CUDA only
    md = seen["md"]
    assert seen["rows"] == 96  # max_num_seqs rows, though the forward had 80 tokens
    assert logits_rows == [96, 80]  # and, while the sampler's logits live, prompt logprobs of every token
    assert all(stage is not None for stage in (md.temperature, md.penalties, md.top_k, md.top_p, md.min_p))
    assert md.max_num_logprobs == 20 and md.generators
    assert md.penalties.output_counts.shape == (96, worker.spec.vocab_size)


@pytest.mark.parametrize(
    "spec, max_num_seqs, expected",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}, 16, 64),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}, 32, 80),
        (None, 32, 32),
    ],
)
def test_the_profile_samples_every_verification_row_a_step_can_have(tiny_model_dir, spec, max_num_seqs, expected):
    """With k proposals a request verifies 1 + k rows: the profile's sampler takes that many for max_num_seqs
    requests, or as many as max_num_batched_tokens (80) allows."""
    settings = {"speculative_config": json.dumps(spec)} if spec else {}
    worker = Worker(
        worker_config(tiny_model_dir("llama"), 64, max_num_seqs=max_num_seqs, max_num_batched_tokens=80, **settings)
    )
    worker.init_device()
    worker.load_model()
    cache = worker._new_cache(worker._profile_blocks())
    cache.bind(worker.model.attention_layers)
    rows = []
    sampler = worker.runner.sampler
    worker.runner.sampler = lambda logits, md: rows.append(logits.shape[0]) or sampler(logits, md)
    worker.profile_forward()
    assert rows == [expected]


def test_a_rank_refuses_a_host_tier_its_host_cannot_give_before_loading_the_model():
    worker = Worker(dataclasses.replace(worker_config("/not/loaded"), swap_space_bytes=1 << 60), rank=1)
    with pytest.raises(ValueError, match=r"swap_space_bytes=\d+ takes \d+ bytes: more than rank 1's host can give"):
        worker.init_device()
    assert worker.model is None


def test_device_cuda_without_cuda_is_refused_before_loading_the_model():
    worker = Worker(dataclasses.replace(worker_config("/not/loaded"), device="cuda"))
    with pytest.raises(ValueError, match="device='cuda' was asked for but torch sees no CUDA device"):
        worker.init_device()
    assert worker.model is None


def test_rope_frequencies_are_computed_on_cpu_whatever_the_default_device():
    """transformers computes inv_freq on CPU; built under `with device:` on a GPU, CUDA's pow could round
    differently and break fp32 greedy equality. The meta device stands in: values there would be lost."""
    from workers.layers import RopeConfig, _inv_freq

    rope = RopeConfig(theta=10000.0)
    with torch.device("meta"):
        inside = _inv_freq(64, rope)
    assert inside.device.type == "cpu" and torch.equal(inside, _inv_freq(64, rope))


def test_own_heads_takes_a_ranks_heads_from_any_split():
    import numpy as np

    from workers.worker import own_heads

    full = np.arange(2 * 1 * 2 * 1 * 4 * 3, dtype=np.uint8).reshape(2, 1, 2, 1, 4, 3)
    halves = [(0, full[..., :2, :]), (2, full[..., 2:, :])]
    assert np.array_equal(own_heads(halves, 1, 2), full[..., 1:3, :])  # across two parts
    assert own_heads(halves, 2, 2) is halves[1][1]  # a whole part: kept, no copy
    assert np.array_equal(own_heads([(0, full)], 3, 1), full[..., 3:, :])
    with pytest.raises(ValueError, match=r"holds heads \['0..1'\]: this rank needs head 2 \(2..3\)"):
        own_heads(halves[:1], 2, 2)
