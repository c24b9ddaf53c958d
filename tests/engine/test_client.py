"""Both executors through engine/client.py's EngineClient, the surface the Serve app talks through: the same greedy
tokens from async generate, aborts that end the stream and free its blocks, stats, routing digest and adapters."""

import asyncio
import inspect
from contextlib import aclosing

import pytest

from engine.client import EngineClient, prompt_block_hashes
from engine.config import EngineConfig
from engine.inprocess import InProcessEngine
from engine.ray_client import RayEngine
from scheduler import EngineRequest, Request, RequestError, SamplingParams
from tests.engine.test_ray_engine import PROMPTS, greedy, run_to_completion

pytestmark = pytest.mark.usefixtures("ray_session")

WAIT_S = 10  # bound on anything asynchronous the tests wait for (a hang fails instead of stalling)


def config(model: str) -> EngineConfig:
    return EngineConfig(model=model, block_size=8, max_model_len=256, max_num_batched_tokens=64, kv_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module", params=[InProcessEngine, RayEngine])
def client(request, llama):
    engine = request.param(config(llama))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(llama) -> list[list[int]]:
    """Greedy outputs through the synchronous interface of the in-process engine."""
    engine = InProcessEngine(config(llama))
    try:
        return run_to_completion(engine)
    finally:
        engine.shutdown()


async def tokens(client: EngineClient, request: EngineRequest) -> list[int]:
    async with aclosing(client.generate(request)) as stream:
        return [t async for out in stream for t in out.new_token_ids]


async def drained(client: EngineClient) -> None:
    """Until the engine holds no request and no KV block (a closed Ray stream's abort is sent, not awaited)."""
    async with asyncio.timeout(WAIT_S):
        while (s := await client.get_stats()).num_running or s.num_waiting or s.kv_cache_usage:
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("executor", [InProcessEngine, RayEngine])
def test_both_executors_implement_the_client_protocol(executor):
    for name, member in vars(EngineClient).items():
        if callable(member) and not name.startswith("_"):
            implemented = getattr(executor, name)
            assert inspect.signature(implemented) == inspect.signature(member), name
            assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(member), name


def test_async_generate_gives_the_synchronous_greedy_tokens(client, reference):
    async def run() -> list[list[int]]:
        requests = [
            EngineRequest(request_id=f"g{i}", prompt_token_ids=p, sampling_params=greedy(12))
            for i, p in enumerate(PROMPTS)
        ]
        return list(await asyncio.gather(*(tokens(client, r) for r in requests)))

    assert asyncio.run(run()) == reference
    asyncio.run(drained(client))


def test_abort_ends_the_stream_and_frees_its_blocks(client):
    async def run() -> tuple[list, object]:
        await drained(client)
        steps_before = (await client.get_stats()).num_steps
        request = EngineRequest(request_id="long", prompt_token_ids=PROMPTS[2], sampling_params=greedy(150))
        outs = []
        async with aclosing(client.generate(request)) as stream:
            async for out in stream:
                outs.append(out)
                if len(outs) == 2:
                    await client.abort_request("long")
        await drained(client)
        return outs, (await client.get_stats()).num_steps - steps_before

    outs, steps = asyncio.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert steps < 150  # aborted: its 150 tokens would take a step each


def test_closing_a_stream_early_aborts_it(client):
    async def run() -> None:
        request = EngineRequest(request_id="closed", prompt_token_ids=PROMPTS[1], sampling_params=greedy(150))
        async with aclosing(client.generate(request)) as stream:
            await anext(stream)
        await drained(client)

    asyncio.run(run())


def test_a_bad_request_is_refused_by_the_generate_call(client):
    with pytest.raises(RequestError, match="prompt=\\[\\] is invalid"):
        client.generate(EngineRequest(request_id="empty", prompt_token_ids=[], sampling_params=greedy(4)))


def test_the_routing_digest_holds_the_prompts_block_hashes(client):
    prompt = EngineRequest(request_id="digest", prompt_token_ids=PROMPTS[3], sampling_params=greedy(2))
    hashes = prompt_block_hashes(prompt, client.config.block_size)
    assert hashes == Request(prompt, block_size=client.config.block_size).block_hashes  # the scheduler's keys

    async def run() -> tuple[list[bytes], int, int]:
        await tokens(client, prompt)
        digest, num_requests = await client.routing_digest(10_000)
        return digest, num_requests, await client.prefix_hit_blocks(prompt)

    digest, num_requests, hit = asyncio.run(run())
    assert set(hashes) <= set(digest) and num_requests == 0
    assert hit == len(hashes)


def test_loras_are_off_without_enable_lora(client):
    assert asyncio.run(client.list_loras()) == set()
    with pytest.raises(Exception, match="LoRA"):
        asyncio.run(client.load_lora("sql", "/nonexistent"))
    client.check_health()


def test_a_sampled_request_streams_every_index(client):
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True)

    async def run() -> list:
        request = EngineRequest(request_id="n3", prompt_token_ids=PROMPTS[0], sampling_params=params)
        async with aclosing(client.generate(request)) as stream:
            return [out async for out in stream]

    outs = asyncio.run(run())
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert sum(len(o.new_token_ids) for o in outs) == 15
