"""CUDA graphs of every kind of decode step, captured and replayed on CPU by a stand-in, and every step's launch.

A capture fails (and the engine then decodes eagerly, at a fraction of the speed) where the captured forward reads
a tensor back to the host or makes a shape that depends on a tensor's values; a replay gives wrong tokens where
the forward read an input that is not in the runner's device buffers; and the host waits for the device where a
step's launch reads a tensor back (async scheduling builds the next step while the device runs this one). Here each
model family runs the dispatch CUDA takes (raylm's Triton kernels, under Triton's interpreter on CPU tensors, and
Triton attention) through the runner's own capture (`DecodeGraphs.capture`), `capture_graph` replaced by a
stand-in: it runs the forward under `NoHostReads` at the capture and at every replay, and writes the replay's
output into the tensor the capture returned, as a graph does; every launch runs under `NoHostReads` too. The input
buffers copy between CPU tensors, as on CUDA. Greedy output against the same engine's eager path.
"""

import json
import os
import sys
import warnings
from contextlib import contextmanager

import pytest
import torch

# As in tests/kernels: @triton.jit reads this when it decorates.
assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
    "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment"
)
os.environ["TRITON_INTERPRET"] = "1"

from kernels import fused  # noqa: E402
from kernels.triton_attention import TritonBackend  # noqa: E402
from raylm import SamplingParams  # noqa: E402
from tests.kernels.test_triton_moe import NoHostReads  # noqa: E402
from tests.workers import test_model_runner  # noqa: E402
from tests.workers.test_model_runner import copying_buffers, prompts, run  # noqa: E402
from tests.workers.test_models import MIXTRAL, QWEN3_MOE  # noqa: E402
from workers import decode_graphs  # noqa: E402
from workers.layers import Attention  # noqa: E402

SIZES = [1, 2, 4]


def engine(path: str, **kw):
    """test_model_runner's CPU engine, small: the interpreter's split decode runs one partition a context up to 128
    keys, and a few hundred KV blocks are allocated and listed in no time."""
    return test_model_runner.engine(path, max_model_len=128, kv_cache_bytes=4 << 20, **kw)


@contextmanager
def refusing_host_reads(what: str):
    """NoHostReads, its refusal a test failure: pytest's is a BaseException, which neither the capture's fallback
    nor the engine's handling of a failed step catches, so it names the read instead of a request's empty output."""
    try:
        with NoHostReads():
            yield
    except AssertionError as e:
        pytest.fail(f"{what}: {e}")


class StandInGraph:
    """A captured forward on CPU: each replay runs it again under NoHostReads into the capture's output."""

    def __init__(self, forward, hidden: torch.Tensor):
        self.forward, self.hidden, self.replays = forward, hidden, 0

    def replay(self) -> None:
        # A replay runs no autograd, whatever mode its caller is in (the draft proposes outside inference mode).
        with torch.inference_mode(), refusing_host_reads("a graph's replay"):
            self.hidden.copy_(self.forward())
        self.replays += 1

    def pool(self) -> None:
        return None


def capture_on_cpu(forward, pool) -> tuple[StandInGraph, torch.Tensor]:
    with refusing_host_reads("a graph's capture"):
        hidden = forward()
    return StandInGraph(forward, hidden), hidden


def cuda_dispatch(eng, monkeypatch) -> None:
    """Engine `eng`, built on CPU, switched to the dispatch CUDA takes: the Triton kernels (the interpreter's)
    and Triton attention, the input buffers copying between CPU tensors, adapters' slots in one of them."""
    runner = eng.worker.runner
    monkeypatch.setattr(fused, "on_triton", lambda t: True)
    copying_buffers(runner, token_slots=runner.lora is not None)
    if runner.lora is not None:
        runner.lora.batch.token_slots = runner.buffers.dev["token_slots"]
    runner.attn_backend = TritonBackend()
    models = [runner.model]
    if runner.draft is not None:
        runner.draft.use_buffers(runner.buffers, runner.decode_graphs)
        runner.draft.backend = runner.attn_backend
        models.append(runner.draft.model)
    for layer in (m for model in models for m in model.modules() if isinstance(m, Attention)):
        layer.backend = runner.attn_backend


def graphs_on_cpu(eng, monkeypatch) -> None:
    """`cuda_dispatch`, and the decode graphs (and the draft's) captured by the stand-in at SIZES; then every step's
    launch (its prefill chunks too, and a draft's catch-up) runs under NoHostReads. A capture that fails for
    another reason warns, and the warning is an error here."""
    runner = eng.worker.runner
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(decode_graphs, "capture_graph", capture_on_cpu)
    runner.decode_graphs.sizes = SIZES
    cuda_dispatch(eng, monkeypatch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "CUDA graph capture failed")
        runner.capture_decode_graphs()
    query_lens = runner.decode_graphs.query_lens
    assert set(runner.decode_graphs.graphs) == {(s, q) for s in SIZES for q in query_lens}
    launch = runner.launch

    def launch_reading_nothing(so):
        # What async scheduling rests on: a launch only queues work. (Steps run one after another here, so no
        # unfinished step is left for a launch to finish, the one read it may make.)
        with refusing_host_reads("a step's launch"):
            return launch(so)

    monkeypatch.setattr(runner, "launch", launch_reading_nothing)


def replays(graphs: decode_graphs.DecodeGraphs) -> dict[tuple[int, int], int]:
    return {shape: graph.replays for shape, (graph, _) in graphs.graphs.items() if graph.replays}


PARAMS = [SamplingParams(temperature=0.0, max_tokens=2 + 2 * i, ignore_eos=True) for i in range(3)]
EVERY_SIZE = {(4, 1), (2, 1), (1, 1)}  # three requests decoding together, then two, then one


def assert_replays_give_the_eager_tokens(make_engine, monkeypatch, eager_dispatch=None) -> None:
    """Three requests (PARAMS) through an engine of `make_engine()` eagerly, by its own path or, given
    `eager_dispatch`, switched to that first; then through another's graphs (`graphs_on_cpu`): every request ran to
    its max_tokens, the tokens are the same, and graphs replayed at every size."""
    ids = [p[: 4 + 4 * i] for i, p in enumerate(prompts(3))]  # 4, 8 and 12 tokens: the interpreter is slow
    eager = make_engine()
    if eager_dispatch is not None:
        eager_dispatch(eager, monkeypatch)
    expected = run(eager, ids, PARAMS)
    assert [len(t) for t in expected] == [p.max_tokens for p in PARAMS]  # no request failed
    eng = make_engine()
    graphs_on_cpu(eng, monkeypatch)
    assert run(eng, ids, PARAMS) == expected
    assert set(replays(eng.worker.runner.decode_graphs)) == EVERY_SIZE


FAMILIES = {
    "llama": ("llama", {}),
    "qwen2 (qkv bias)": ("qwen2", {}),
    "qwen3 (q/k norm)": ("qwen3", dict(head_dim=32)),
    "mistral (sliding window 6)": ("mistral", dict(sliding_window=6)),
    "qwen3_moe": ("qwen3_moe", QWEN3_MOE),
    "mixtral": ("mixtral", MIXTRAL),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_decodes_replay_graphs_that_read_nothing_on_the_host(tiny_model_dir, monkeypatch, family):
    """Against the torch path's tokens."""
    model_type, overrides = FAMILIES[family]
    path = tiny_model_dir(model_type, None, **overrides)
    assert_replays_give_the_eager_tokens(lambda: engine(path), monkeypatch)


def test_a_draft_models_verifications_and_passes_replay_graphs_that_read_nothing_on_the_host(
    tiny_model_dir, monkeypatch
):
    """k = 3 with the target as its own draft (greedy verification accepts every proposal): the target verifies
    three proposals a request by the graphs of 4-token requests, and the draft's catch-up and proposal passes
    replay graphs of its own."""
    path = tiny_model_dir("llama")
    ids = prompts(2, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 4 * i, ignore_eos=True) for i in range(2)]
    expected = run(engine(path), ids, params)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    eng = engine(path, speculative_config=json.dumps(spec))
    graphs_on_cpu(eng, monkeypatch)
    assert run(eng, ids, params) == expected
    runner = eng.worker.runner
    assert (2, 4) in replays(runner.decode_graphs)
    assert (2, 1) in replays(runner.draft.graphs)
    stats = eng.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_lora_decodes_replay_one_graph_for_every_mix_of_adapters(lora_adapters, monkeypatch):
    """Each token's adapter slot is a device buffer the graph reads in place: the base model and two adapters
    mixed in one batch, then each alone, replay the same graphs and give peft's tokens."""
    from tests.workers.test_lora import lora_engine
    from tests.workers.test_lora import run as run_lora

    base, paths, prompts_, expected = lora_adapters
    eng = lora_engine(base, paths, max_loras=2)
    graphs_on_cpu(eng, monkeypatch)
    mixed = [(None, prompts_[0]), ("attn8", prompts_[0]), ("all4", prompts_[1])]
    assert run_lora(eng, mixed) == [expected[name][prompts_.index(p)] for name, p in mixed]
    assert run_lora(eng, [("all4", prompts_[0])]) == [expected["all4"][0]]
    assert (4, 1) in replays(eng.worker.runner.decode_graphs)


def test_fp8_kv_pages_are_read_by_replayed_graphs(tiny_model_dir, monkeypatch):
    """--kv-cache-dtype fp8: the graphs store and read FP8 pages as the same kernels do eagerly. Against the
    Triton kernels' eager path, not torch's: the interpreter casts some values to FP8 a binade low (1.97 to 1.0:
    the rounding's carry is dropped, triton-lang/triton#8322), so on CPU its pages are not torch's."""
    path = tiny_model_dir("llama")
    assert_replays_give_the_eager_tokens(lambda: engine(path, kv_cache_dtype="fp8"), monkeypatch, cuda_dispatch)


FP8_WEIGHTS = {
    "llama, fp8 blocks 32x32": ("llama", "fp8 blocks 32x32"),
    "llama, fp8 per tensor (static activations)": ("llama", "fp8 per tensor (static activations)"),
    "qwen3_moe, --quantization fp8": ("qwen3_moe", None),
    "qwen3_moe, fp8 blocks 32x32": ("qwen3_moe", "fp8 blocks 32x32"),  # Qwen3-30B-A3B-FP8's layout, smaller tiles
}


@pytest.mark.parametrize("case", FP8_WEIGHTS)
def test_fp8_products_replay_graphs_that_read_nothing_on_the_host(tiny_model_dir, tmp_path, monkeypatch, case):
    """FP8 weights as CUDA holds them (`fp8_products`; CPU serving keeps them dequantized): each token's or the
    tensor's activations quantized, then torch's scaled matmul, the Triton block kernel or the experts' grouped
    FP8 products, through the graphs as through the same kernels eagerly (the interpreter's FP8 casts are not
    torch's: see above). The static checkpoint's one-token steps failed in `_scaled_mm` before its activations'
    [1, 1] scale had a stride along the row."""
    from tests.workers.fp8 import SCHEMES, write_fp8_checkpoint
    from workers.quantization.conversion import fp8_products

    model_type, scheme = FP8_WEIGHTS[case]
    path = tiny_model_dir(model_type, None, **({} if model_type == "llama" else QWEN3_MOE))
    kw = {"quantization": "fp8"} if scheme is None else {}
    if scheme is not None:
        write_fp8_checkpoint(path, tmp_path, SCHEMES[scheme])
        path = str(tmp_path)

    def fp8_engine():
        eng = engine(path, **kw)
        assert fp8_products(eng.worker.runner.model, eng.worker.spec.quantization)
        return eng

    assert_replays_give_the_eager_tokens(fp8_engine, monkeypatch, cuda_dispatch)


def test_sampled_verifications_launch_reading_nothing_on_the_host_on_cudas_sampler(tiny_model_dir, monkeypatch):
    """Rejection sampling of n-gram proposals beside a request that takes none (penalties and a seed), top-k,
    top-p, min-p and logprobs, through the sampler's CUDA paths (the exponential race, top-p by a sort), graphs
    and launches under NoHostReads: each request still makes its max_tokens. (A draft model's proposals reach
    the same verification; its passes are the greedy test's above.)"""
    from kernels import cpu_ops
    from workers import sampler

    path = tiny_model_dir("llama")
    monkeypatch.setattr(sampler, "_draw", sampler._exponential_race)
    monkeypatch.setattr(cpu_ops, "_native", lambda x: False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    eng = engine(path, speculative_config=json.dumps(spec))
    graphs_on_cpu(eng, monkeypatch)
    sampled = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, logprobs=2)
    penalized = dict(repetition_penalty=1.2, presence_penalty=0.3, seed=1)  # seeds and penalties: no proposals
    params = [SamplingParams(**sampled, **(penalized if i == 1 else {}), max_tokens=4 + 2 * i) for i in range(3)]
    ids = [(p[:6] * 3)[: 8 + 4 * i] for i, p in enumerate(prompts(3))]  # repetitive: n-gram finds proposals
    assert [len(t) for t in run(eng, ids, params)] == [p.max_tokens for p in params]
    assert eng.stats().spec_decode_num_draft_tokens > 0
    assert any(q == 4 for _, q in replays(eng.worker.runner.decode_graphs))  # verifications replayed
