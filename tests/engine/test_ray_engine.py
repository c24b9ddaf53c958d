"""The Ray engine on a real (local) Ray: tensor parallelism, streaming, continuous batching, aborts,
failures and placement. Tiny random models and few tokens keep it fast."""

import asyncio
import inspect
import sys
import threading
import time

import pytest
import ray
import torch

from engine.config import EngineConfig
from engine.inprocess import InProcessEngine
from engine.interface import Engine
from engine.ray_client import RayEngine
from scheduler import EngineRequest, RequestError, SamplingParams
from tests.ray_session import SESSION_CPUS

pytestmark = pytest.mark.usefixtures("ray_session")

WAIT_S = 10  # bound on anything asynchronous the tests wait for (a hang fails instead of stalling)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


_rng = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(3, 256, (n,), generator=_rng).tolist() for n in (5, 19, 40, 70)]


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig(
        model=model, block_size=8, max_model_len=256, max_num_batched_tokens=64, kv_cache_bytes=1 << 22, **kw
    )


def run_to_completion(engine, prompts=PROMPTS, max_tokens=12) -> list[list[int]]:
    """Greedy outputs through the synchronous interface (what the offline LLM drives)."""
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=greedy(max_tokens)))
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[str(i)] for i in range(len(prompts))]


def wait_until(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def bounded(fn, what: str, timeout_s: float = WAIT_S):
    """``fn()`` in a daemon thread, failing the test if it has not returned within ``timeout_s``. A hung call
    then fails fast: a thread pool (or asyncio.to_thread) would wait for it when it shuts down."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"not within {timeout_s} s: {what}")
    if "error" in result:
        raise result["error"]
    return result["value"]


def is_drained(engine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(llama) -> list[list[int]]:
    """tp=1 greedy outputs of the in-process engine (no Ray)."""
    return run_to_completion(InProcessEngine(config(llama)))


@pytest.fixture(scope="module")
def engine(llama, lora_adapters):
    """A tp=2 engine shared by the tests that leave it healthy; LoRA on (one slot), one adapter loaded at start:
    requests of the base model run as without LoRA."""
    base, paths, _, _ = lora_adapters
    assert base == llama
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules=[f"attn8={paths['attn8']}"])
    e = RayEngine(config(llama, tensor_parallel_size=2, async_scheduling=True, **lora))
    yield e
    e.shutdown()


def test_tp2_greedy_matches_tp1_with_kv_heads_split(engine, reference):
    assert run_to_completion(engine) == reference
    assert engine.spec.kv_heads_per_rank(2) == 1


def test_tp2_lora_adapters_match_peft_mixed_with_the_base(engine, lora_adapters):
    """Adapters sliced like their layers over 2 ranks: one loaded at start, one at run time while the others'
    requests run; with one slot, the requests of the adapter not resident wait for it."""
    _, paths, prompts, expected = lora_adapters
    with pytest.raises(RequestError, match="'all4'"):
        engine.add_request(
            EngineRequest(request_id="nope", prompt_token_ids=prompts[0], sampling_params=greedy(4), lora_name="all4")
        )
    mixed = [(name, p) for p in prompts for name in (None, "attn8", "all4")]
    for i, (name, prompt) in enumerate(mixed):  # the base's and attn8's requests run while all4 loads
        if name != "all4":
            engine.add_request(
                EngineRequest(
                    request_id=f"lora{i}", prompt_token_ids=prompt, sampling_params=greedy(12), lora_name=name
                )
            )
    engine.add_lora("all4", paths["all4"])
    try:
        with pytest.raises(ValueError, match="'all4'.*already loaded"):
            engine.add_lora("all4", paths["all4"])
        for i, (name, prompt) in enumerate(mixed):
            if name == "all4":
                engine.add_request(
                    EngineRequest(
                        request_id=f"lora{i}", prompt_token_ids=prompt, sampling_params=greedy(12), lora_name=name
                    )
                )
        got = {f"lora{i}": [] for i in range(len(mixed))}
        while engine.has_unfinished_requests():
            for o in bounded(engine.step, "a LoRA step"):
                got[o.request_id].extend(o.new_token_ids)
        assert [got[f"lora{i}"] for i in range(len(mixed))] == [expected[n][prompts.index(p)] for n, p in mixed]
    finally:
        engine.remove_lora("all4")
    assert engine.lora_names() == {"attn8"}


def test_tp2_greedy_matches_tp1_with_kv_heads_replicated(tiny_model_dir):
    model = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=1)
    expected = run_to_completion(InProcessEngine(config(model)))
    e = RayEngine(config(model, tensor_parallel_size=2))
    try:
        assert run_to_completion(e) == expected
    finally:
        e.shutdown()


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_tp2_with_speculation_matches_tp1(llama, reference, method):
    """Proposals verified by the tp=2 target under async scheduling give tp=1's output without speculation. The
    draft (here the target itself, unsharded on rank 0) has every proposal accepted; n-gram's proposals (from the
    scheduler, sent to both ranks) are made and verified."""
    if method == "draft_model":
        spec = {"method": "draft_model", "model": llama, "num_speculative_tokens": 3}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    e = RayEngine(config(llama, tensor_parallel_size=2, speculative_config=spec))
    try:
        assert run_to_completion(e) == reference
        stats = e.stats()
        assert stats.spec_decode_num_draft_tokens > 0
        if method == "draft_model":
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    finally:
        e.shutdown()


def test_streaming_yields_each_token_as_it_is_sampled(engine, reference):
    async def consume():
        return [
            d
            async for d in engine.generate(
                EngineRequest(request_id="stream", prompt_token_ids=PROMPTS[1], sampling_params=greedy(8))
            )
        ]

    deltas = asyncio.run(asyncio.wait_for(consume(), WAIT_S))
    assert [len(d.new_token_ids) for d in deltas] == [1] * 8
    assert [d.finished for d in deltas] == [False] * 7 + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_prompt_tokens == len(PROMPTS[1])
    assert [t for d in deltas for t in d.new_token_ids] == reference[1][:8]


def test_streaming_n_samples_reports_every_index(engine):
    params = SamplingParams(n=3, seed=5, max_tokens=4, ignore_eos=True)

    async def consume():
        return [
            d
            async for d in engine.generate(
                EngineRequest(request_id="n3", prompt_token_ids=PROMPTS[0], sampling_params=params)
            )
        ]

    deltas = asyncio.run(asyncio.wait_for(consume(), WAIT_S))
    for index in range(3):
        mine = [d for d in deltas if d.index == index]
        assert sum(len(d.new_token_ids) for d in mine) == 4 and mine[-1].finished


def test_dropping_a_stream_mid_way_aborts_it_and_frees_its_blocks(engine):
    steps_before = engine.stats().num_steps

    async def take_three_then_drop():
        stream = engine.generate(
            EngineRequest(request_id="dropped", prompt_token_ids=PROMPTS[3], sampling_params=greedy(150))
        )
        got = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        return got

    got = asyncio.run(asyncio.wait_for(take_three_then_drop(), WAIT_S))
    assert not any(d.finished for d in got)
    wait_until(lambda: is_drained(engine), "the dropped request's blocks are freed")
    assert engine.stats().num_steps - steps_before < 150  # aborted: its 150 tokens would take a step each


def test_cancelling_a_consumer_aborts_its_request(engine):
    steps_before = engine.stats().num_steps

    async def cancel_after_first_token():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate(
                EngineRequest(request_id="cancelled", prompt_token_ids=PROMPTS[2], sampling_params=greedy(150))
            ):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancel_after_first_token(), WAIT_S))
    wait_until(lambda: is_drained(engine), "the cancelled request's blocks are freed")
    assert engine.stats().num_steps - steps_before < 150  # aborted: its 150 tokens would take a step each


def test_a_second_generate_with_a_running_id_is_refused_and_the_first_runs_on(engine, reference):
    async def both() -> list:
        first = engine.generate(
            EngineRequest(request_id="twice", prompt_token_ids=PROMPTS[1], sampling_params=greedy(8))
        )
        deltas = [await anext(first)]
        with pytest.raises(ValueError, match="'twice' is invalid: a request with this id is still running"):
            await anext(
                engine.generate(
                    EngineRequest(request_id="twice", prompt_token_ids=PROMPTS[2], sampling_params=greedy(8))
                )
            )
        return deltas + [d async for d in first]

    deltas = asyncio.run(asyncio.wait_for(both(), WAIT_S))
    assert [t for d in deltas for t in d.new_token_ids] == reference[1][:8] and deltas[-1].finished


def test_a_new_request_joins_the_running_batch_while_others_decode(engine):
    """(That it joins in the very step scheduled after it arrived: tests/engine/test_scheduler_actor.py.)"""
    deltas: list[tuple[str, bool]] = []  # (caller id, finished), in the order the callers received them

    async def scenario():
        late: list[asyncio.Task] = []

        async def consume(rid, prompt, params, on_token=None):
            n = 0
            async for d in engine.generate(
                EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)
            ):
                n += len(d.new_token_ids)
                deltas.append((rid, d.finished))
                if on_token:
                    on_token(n)

        def submit_c_after_four(n):
            if n == 4 and not late:
                late.append(asyncio.create_task(consume("C", PROMPTS[0], greedy(3))))

        await asyncio.gather(
            consume("A", PROMPTS[1], greedy(40), submit_c_after_four), consume("B", PROMPTS[2], greedy(40))
        )
        await late[0]

    asyncio.run(asyncio.wait_for(scenario(), 2 * WAIT_S))
    after_c = {rid for rid, _ in deltas[deltas.index(("C", True)) + 1 :]}
    assert after_c == {"A", "B"}  # C, arriving while they decode, ran beside them instead of after them


def run_mixed(engine, stop: int) -> dict:
    """A mixed batch through the synchronous interface: (tokens, finish reason, logprobs) per sample."""
    batch = [
        (PROMPTS[0], greedy(9)),
        (PROMPTS[1], SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=7)),
        (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])),
        (PROMPTS[3], greedy(3, presence_penalty=1.0, logprobs=2)),
    ]
    got: dict = {}
    for i, (prompt, params) in enumerate(batch):
        engine.add_request(EngineRequest(request_id=f"m{i}", prompt_token_ids=prompt, sampling_params=params))
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens, _, logprobs = got.get((o.request_id, o.index), ([], None, []))
            got[(o.request_id, o.index)] = (
                tokens + o.new_token_ids,
                o.finish_reason,
                logprobs + (o.new_logprobs or []),
            )
    return got


def test_async_scheduling_gives_the_serial_loops_outputs_token_for_token(engine, reference, llama):
    stop = reference[2][4]  # m2 stops on its fifth token, its next step already in flight
    serial = RayEngine(config(llama, tensor_parallel_size=2, async_scheduling=False))
    try:
        expected = run_mixed(serial, stop)
    finally:
        serial.shutdown()
    got = run_mixed(engine, stop)
    # Tokens and finish reasons exactly; logprobs to float32's rounding, as the two loops batch differently (a
    # product of at most 8 rows takes another kernel than a larger one, workers/layers.py).
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in expected.items()} and len(got) == 5
    for key, (_, _, logprobs) in got.items():
        want = expected[key][2]
        assert [(lp.top_token_ids, lp.rank) for lp in logprobs] == [(lp.top_token_ids, lp.rank) for lp in want]
        flat = [v for lp in logprobs for v in (lp.logprob, *lp.top_logprobs)]
        assert flat == pytest.approx([v for lp in want for v in (lp.logprob, *lp.top_logprobs)], abs=1e-5)
    assert got[("m2", 0)][:2] == (reference[2][: reference[2].index(stop) + 1], "stop")
    assert is_drained(engine)


def test_bad_prompt_is_refused_before_it_reaches_the_engine(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(EngineRequest(request_id="bad", prompt_token_ids=[1, 2, 10**6], sampling_params=greedy(4)))

    async def consume():
        return [
            d
            async for d in engine.generate(
                EngineRequest(request_id="bad", prompt_token_ids=[], sampling_params=greedy(4))
            )
        ]

    with pytest.raises(RequestError, match="prompt=\\[\\] is invalid: it must have at least one token"):
        asyncio.run(consume())
    engine.check_health()


@pytest.mark.parametrize("executor", [InProcessEngine, RayEngine])
def test_both_executors_implement_the_engine_interface(executor):
    for name, member in vars(Engine).items():
        if callable(member) and not name.startswith("_"):
            assert inspect.signature(getattr(executor, name)) == inspect.signature(member), name


def test_scheduler_actor_process_never_imports_torch(engine):
    assert not ray.get(engine.actor.__ray_call__.remote(lambda _: "torch" in sys.modules))


def test_rank_processes_import_no_transformers(engine):
    """A rank takes its model spec from the engine (WorkerConfig.model_spec) and imports structured outputs'
    tokenizer only at the first constraint: transformers' import would add 1.6 CPU-s to every rank's start."""
    imported = ray.get([w.__ray_call__.remote(lambda _: "transformers" in sys.modules) for w in engine.workers])
    assert imported == [False, False]


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_dead_worker_fails_in_flight_requests_and_health_then_a_new_engine_works(llama, reference, dead_rank):
    e = RayEngine(config(llama, tensor_parallel_size=2))
    try:
        e.add_request(EngineRequest(request_id="sync", prompt_token_ids=PROMPTS[0], sampling_params=greedy(200)))

        async def kill_mid_generation():
            streams = [
                e.generate(EngineRequest(request_id=f"s{i}", prompt_token_ids=p, sampling_params=greedy(200)))
                for i, p in enumerate(PROMPTS[1:3])
            ]
            for s in streams:
                assert not (await anext(s)).finished
            ray.kill(e.workers[dead_rank])
            finals = []
            for s in streams:
                finals.append([d async for d in s][-1])
            return finals

        finals = asyncio.run(asyncio.wait_for(kill_mid_generation(), WAIT_S))

        def drain_sync():
            outs = []
            while e.has_unfinished_requests():
                outs += e.step()
            return outs

        finals.append(bounded(drain_sync, "the synchronous request fails")[-1])
        assert [(f.finished, f.finish_reason) for f in finals] == [(True, "error")] * 3
        assert all("engine step failed" in f.error for f in finals)
        with pytest.raises(RuntimeError, match="unhealthy"):
            e.check_health()
        with pytest.raises(RuntimeError, match="unhealthy"):
            e.add_request(EngineRequest(request_id="late", prompt_token_ids=PROMPTS[0], sampling_params=greedy(4)))
    finally:
        e.shutdown()
    fresh = RayEngine(config(llama, tensor_parallel_size=2))
    try:
        assert run_to_completion(fresh) == reference
        fresh.check_health()
    finally:
        fresh.shutdown()


# Thread counts against the session's SESSION_CPUS logical CPUs (10): a scheduler bundle of 1 plus rank bundles.
@pytest.mark.parametrize(
    "overrides, missing",
    [
        ({"device": "cuda"}, "GPU: 1"),  # no GPU in the cluster
        ({"accelerator_type": "H100", "tensor_parallel_size": 2}, "accelerator_type:H100: 0.002"),  # no such node
        ({"tensor_parallel_size": 2, "num_threads": 5}, "CPU: 1"),  # 1 + 2 * 5 CPUs
        # 1 + 2 stages * 2 ranks * 3 CPUs; each stage fits on the one node, the whole does not
        (
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_threads": 3},
            r"CPU: 3; per stage: stage 0 \(ranks 0-1\) needs CPU: 6 on one node; stage 1 \(ranks 2-3\) needs CPU: 6",
        ),
        # a stage larger than any node: named as such
        (
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "num_threads": 6},
            r"CPU: 15; .*stage 1 \(ranks 2-3\) needs CPU: 12 on one node: no node is that large "
            rf"\(the largest has CPU: {SESSION_CPUS}\)",
        ),
    ],
    ids=["no GPU", "no H100 node", "tp2 over the CPUs", "pp2 over the CPUs", "a stage larger than any node"],
)
def test_unsatisfiable_placement_fails_within_the_timeout_and_cleans_up(llama, overrides, missing):
    before = set(ray.util.placement_group_table())
    with pytest.raises(RuntimeError, match=f"cannot place the engine.*missing: {missing}"):
        bounded(lambda: RayEngine(config(llama, placement_timeout_s=1, **overrides)), "placement gives up")
    table = ray.util.placement_group_table()
    assert {table[pg]["state"] for pg in set(table) - before} == {"REMOVED"}


def _bound_cores(_actor) -> list[int]:
    """Runs in a rank: the cores of the thread running its tasks, the one that ran init_device (torch's thread 0)."""
    import os

    return sorted(os.sched_getaffinity(0))


def test_on_cpu_each_ranks_threads_are_bound_to_its_own_cores_by_default(engine):
    import os

    from workers.cpu_binding import plan_binding, primary_cores

    cores = sorted(os.sched_getaffinity(0))
    plan = plan_binding("auto", cores, primary_cores(cores), 2, None, on_gpu=False)
    if plan is None:
        pytest.skip("one core: two ranks' threads cannot each have their own")
    assert ray.get([w.__ray_call__.remote(_bound_cores) for w in engine.workers]) == [[p[0]] for p in plan]


def test_a_binding_naming_cores_the_node_lacks_is_refused_at_start_and_cleans_up(llama):
    before = set(ray.util.placement_group_table())
    with pytest.raises(ValueError, match=r"cpu_omp_threads_bind='0-4095' names cores .* that node .* has cores"):
        bounded(lambda: RayEngine(config(llama, cpu_omp_threads_bind="0-4095")), "the refusal", 60)
    table = ray.util.placement_group_table()
    assert {table[pg]["state"] for pg in set(table) - before} == {"REMOVED"}
