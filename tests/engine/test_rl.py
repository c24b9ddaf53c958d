"""RL rollouts on the in-process engine (issue #71), the default model at tp=1: greedy output unchanged by sleep and
wake at both levels (KV garbage left after the wake changes nothing: the prefix cache was forgotten), by an update
with the same weights, equal to transformers' after an update that changes them, kept by a refused update; and
through the async face a pause that keeps its requests, and a request held while paused."""

import asyncio
from contextlib import aclosing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylm import LLM, SamplingParams
from scheduler import EngineRequest
from tests.engine.conftest import NEW_TOKENS

WAIT_S = 30  # bound on anything asynchronous the tests wait for (a hang fails instead of stalling)


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    llm = LLM(model=default_model_dir, executor="inprocess", max_model_len=256)
    yield llm
    llm.shutdown()


def tokens(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_ids, greedy(), use_tqdm=False)]


def checkpoint(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for f in sorted(Path(model_dir).glob("*.safetensors")) for n, t in load_file(f).items()]


def garble_kv(llm: LLM) -> None:
    """What a woken cache might hold (its fresh tensors are zeros): a prefix hit on it would change the output."""
    llm.engine.worker.cache.kv_cache.normal_(0.0, 10.0)


@pytest.fixture(scope="module")
def original(llm, changed_model) -> list[list[int]]:
    """The original model's greedy tokens for the prompts (every test leaves the original weights behind)."""
    return tokens(llm, changed_model.prompt_ids)


def test_sleep_and_wake_keep_the_greedy_output(llm, changed_model, original, default_model_dir):
    ids, before = changed_model.prompt_ids, original
    llm.sleep(1)
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.generate(ids, greedy(), use_tqdm=False)
    llm.wake_up()
    garble_kv(llm)
    assert not llm.is_sleeping() and tokens(llm, ids) == before
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.update_weights_from_tensor(checkpoint(default_model_dir), weight_version="same")
    llm.wake_up(["kv_cache"])
    garble_kv(llm)
    assert tokens(llm, ids) == before and llm.weight_version == "same"
    assert llm.engine.stats().weight_version == "same"


def test_an_update_serves_the_changed_model_and_a_refused_one_keeps_it(llm, changed_model, original, default_model_dir):
    llm.update_weights_from_tensor(changed_model.tensors, weight_version="step-1")
    name, tensor = changed_model.tensors[0]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):  # zeros first, then a bad shape: all or none
        zeros = (changed_model.tensors[1][0], torch.zeros_like(changed_model.tensors[1][1]))
        llm.update_weights_from_tensor([zeros, (name, tensor[:-1])])
    assert tokens(llm, changed_model.prompt_ids) == changed_model.greedy != original
    assert llm.weight_version == "step-1"
    names = {n for n, _ in changed_model.tensors}
    llm.update_weights_from_tensor([(n, t) for n, t in checkpoint(default_model_dir) if n in names])


def test_pause_keep_and_a_request_held_while_paused_through_the_async_face(llm, changed_model, original):
    engine, ids = llm.engine, changed_model.prompt_ids

    async def stream(i: int, seen: list) -> None:
        request = EngineRequest(request_id=f"s{i}", prompt_token_ids=ids[i], sampling_params=greedy())
        async with aclosing(engine.generate(request)) as deltas:
            async for out in deltas:
                seen.extend(out.new_token_ids)

    async def run() -> None:
        seen: list[list[int]] = [[], [], []]
        first = [asyncio.ensure_future(stream(i, seen[i])) for i in (0, 1)]
        while len(seen[0]) < 2:
            await asyncio.sleep(0.01)
        assert await engine.pause_generation("keep") == 0 and await engine.is_paused()
        held = asyncio.ensure_future(stream(2, seen[2]))
        await asyncio.sleep(0.05)  # the streams take the deltas of the steps applied before the pause returned
        frozen = [list(s) for s in seen]
        await asyncio.sleep(0.3)
        assert seen == frozen and 0 < len(seen[0]) < NEW_TOKENS and not seen[2]
        await engine.resume_generation()
        await asyncio.wait_for(asyncio.gather(*first, held), WAIT_S)
        assert seen == original

    asyncio.run(run())
    assert engine.stats().kv_cache_usage == 0
