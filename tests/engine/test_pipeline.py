"""Pipeline parallelism on a real (local) Ray: the layers cut into stages, each stage's activations handed to the
next over gloo, several steps in flight. Greedy output must equal transformers' token for token, with prefix
caching, chunked prefill, preemption and n=2 all exercised in the same runs."""

import pytest
import ray
import torch

from engine.config import EngineConfig
from engine.ray_client import RayEngine
from scheduler import EngineRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("ray_session")

NUM_LAYERS = 5
BLOCK_SIZE = 8
MAX_TOKENS = 10
_rng = torch.Generator().manual_seed(2)
# The last prompt repeats the third's first 32 tokens: a prefix-cache hit once the third has run.
PROMPTS = [torch.randint(3, 256, (n,), generator=_rng).tolist() for n in (5, 19, 40, 70)]
PROMPTS.append(PROMPTS[2][:32] + [7, 8, 9])


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama", num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one full forward per token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


def pipelined(model: str, tp: int, pp: int, blocks: int, most_layers: int, **kw) -> RayEngine:
    """An engine whose KV cache holds ``blocks`` blocks on its largest stage (``most_layers`` layers): too few for
    every request at once, so the scheduler preempts."""
    block_bytes = 2 * most_layers * BLOCK_SIZE * (2 // tp) * 16 * 4
    return RayEngine(
        EngineConfig(
            model=model,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            block_size=BLOCK_SIZE,
            max_model_len=128,
            max_num_batched_tokens=48,  # the 70-token prompt is prefilled in chunks
            kv_cache_bytes=blocks * block_bytes,
            **kw,
        )
    )


def run(engine: RayEngine) -> dict[str, list[list[int]]]:
    """Every prompt with n=2 greedy samples, through the synchronous interface; each request's samples by index."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(
            EngineRequest(
                request_id=str(i),
                prompt_token_ids=p,
                sampling_params=SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            )
        )
    got = {str(i): [[], []] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id][o.index].extend(o.new_token_ids)
    return got


@pytest.mark.parametrize(
    "tp, pp, partition, most_layers",
    [(1, 3, None, 2), (2, 2, "4,1", 4)],  # 2,2,1 layers; an explicit partition (engine start is most of the time)
    ids=["pp3", "tp2xpp2"],
)
def test_pipeline_greedy_matches_transformers(model, expected, tp, pp, partition, most_layers):
    engine = pipelined(model, tp, pp, 14, most_layers, pp_layer_partition=partition)
    try:
        got = run(engine)
        stats = engine.stats()
        if tp == 2:
            a_stage_1_rank_killed_mid_stream_fails_the_engine(engine)
    finally:
        engine.shutdown()
    for i, want in enumerate(expected):
        assert got[str(i)] == [want, want], f"prompt {i}"
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


def a_stage_1_rank_killed_mid_stream_fails_the_engine(engine: RayEngine) -> None:
    """Rank 2 (stage 1's first, the driver) dies while a request streams: the request ends with an error, and
    the health check names the stage and the rank."""
    finals = engine.add_request(
        EngineRequest(
            request_id="long",
            prompt_token_ids=PROMPTS[0],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        )
    )
    assert not finals  # it fits the 14-block cache: not refused at once
    first: list = []
    while not first:
        first = engine.step()
    assert not first[-1].finished
    ray.kill(engine.workers[2])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "error", outs[-1]
    with pytest.raises(RuntimeError, match="stage 1, rank 2 on node"):
        engine.check_health()


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(pipeline_parallel_size=6), ["pipeline_parallel_size=6", "5 layers"]),
        (dict(pipeline_parallel_size=2, pp_layer_partition="2,2"), ["pp_layer_partition=2,2", "sum to", "5 layers"]),
    ],
)
def test_impossible_split_is_refused_before_any_rank_starts(model, kw, words):
    with pytest.raises(ValueError) as e:
        RayEngine(EngineConfig(model=model, **kw))
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(pipeline_parallel_size=0), ["pipeline_parallel_size", "greater than or equal to 1"]),
        (dict(pipeline_parallel_size=1.5), ["pipeline_parallel_size", "integer"]),
        (dict(pipeline_parallel_size=2, pp_layer_partition="3"), ["1 entries", "pipeline_parallel_size=2"]),
        (dict(pipeline_parallel_size=2, pp_layer_partition="3,x"), ["pp_layer_partition", "positive integers"]),
    ],
)
def test_bad_pipeline_settings_are_refused_by_the_config(kw, words):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_mixture_of_experts_model_splits_into_stages(tiny_model_dir):
    """Qwen3-MoE (its first layer dense, the second with experts) cut into two stages: greedy equal to transformers."""
    from tests.workers.test_families import transformers_greedy
    from tests.workers.test_models import QWEN3_MOE_DENSE_FIRST

    path = tiny_model_dir("qwen3_moe", None, **QWEN3_MOE_DENSE_FIRST)
    engine = RayEngine(EngineConfig(model=path, pipeline_parallel_size=2, block_size=BLOCK_SIZE, max_model_len=128))
    try:
        for i, p in enumerate(PROMPTS[:3]):
            engine.add_request(
                EngineRequest(
                    request_id=str(i),
                    prompt_token_ids=p,
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                )
            )
        got = {str(i): [] for i in range(3)}
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert o.error is None, o.error
                got[o.request_id].extend(o.new_token_ids)
    finally:
        engine.shutdown()
    assert list(got.values()) == transformers_greedy(path, PROMPTS[:3], MAX_TOKENS)
