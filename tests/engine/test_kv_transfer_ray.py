"""A prompt's KV moved between two Ray engines of different tensor-parallel sizes through the object store: each
rank ships its own heads, the decode engine gives the unified engine's greedy tokens, and a transfer whose
prefill engine is gone fails with KVTransferError, leaving nothing allocated."""

import asyncio
import dataclasses

import pytest
import ray

from engine.inprocess import InProcessEngine
from engine.ray_client import RayEngine
from scheduler import EngineRequest, KVTransferError
from tests.engine.test_ray_engine import PROMPTS, config, greedy, is_drained, run_to_completion, wait_until

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def engines(llama):
    tp2, tp1 = RayEngine(config(llama, tensor_parallel_size=2)), RayEngine(config(llama))
    yield tp2, tp1
    tp2.shutdown()
    tp1.shutdown()


def gone(actor) -> bool:
    try:
        ray.get(actor.check_health.remote(), timeout=1)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True
    return False


def lost(ref) -> bool:
    try:
        ray.get(ref, timeout=1)
    except Exception:
        return True
    return False


async def collect(engine: RayEngine, request: EngineRequest) -> list:
    return [out async for out in engine.generate(request)]


async def disaggregated(prefill: RayEngine, decode: RayEngine, request: EngineRequest) -> list[int]:
    first_block = await decode.prefix_hit_blocks(request)
    one = dataclasses.replace(request.sampling_params, max_tokens=1)
    (first,) = await collect(
        prefill, dataclasses.replace(request, sampling_params=one, kv_export_from_block=first_block)
    )
    assert len(first.kv_transfer.parts) == prefill.config.tensor_parallel_size
    rest = await collect(decode, dataclasses.replace(request, kv_transfer=first.kv_transfer))
    return first.new_token_ids + [t for out in rest for t in out.new_token_ids]


def test_kv_moves_between_tp2_and_tp1_engines_both_ways_with_and_without_prefix_hits(engines, llama):
    tp2, tp1 = engines
    expected = run_to_completion(InProcessEngine(config(llama)), PROMPTS, max_tokens=8)

    async def run() -> list[list[int]]:
        got = []
        for prefill, decode in ((tp2, tp1), (tp1, tp2), (tp2, tp1)):  # the third: the decode engine holds prefixes
            for i, prompt in enumerate(PROMPTS):
                request = EngineRequest(request_id=f"{len(got)}", prompt_token_ids=prompt, sampling_params=greedy(8))
                got.append(await disaggregated(prefill, decode, request))
                assert got[-1] == expected[i]
        return got

    asyncio.run(run())
    wait_until(lambda: is_drained(tp1) and is_drained(tp2), "both engines drained")


def test_a_transfer_whose_prefill_engine_is_gone_fails_and_leaves_nothing(engines, llama):
    _, decode = engines
    prefill = RayEngine(config(llama))
    request = EngineRequest(request_id="lost", prompt_token_ids=PROMPTS[3], sampling_params=greedy(8))

    async def run() -> None:
        one = dataclasses.replace(request.sampling_params, max_tokens=1)
        (first,) = await collect(prefill, dataclasses.replace(request, sampling_params=one, kv_export_from_block=0))
        workers = prefill.workers
        prefill.shutdown()  # its ranks owned the parts: the objects go with them
        wait_until(lambda: gone(workers[0]), "the prefill engine's rank is dead")
        wait_until(lambda: lost(first.kv_transfer.parts[0].data), "the object its rank owned is lost", 30)
        with pytest.raises(KVTransferError, match="'lost': its prompt's KV did not reach every rank"):
            await collect(decode, dataclasses.replace(request, kv_transfer=first.kv_transfer))

    asyncio.run(run())
    wait_until(lambda: is_drained(decode), "the decode engine holds nothing")
