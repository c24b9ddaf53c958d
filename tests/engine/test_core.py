"""The engine core (engine/core.py) without a transport: an outbox keeps a batch until its caller
acknowledges it, so a call that returns to a caller who is gone (a pump cancelled too late) loses nothing and a
received batch never repeats; the loop driven one step at a time, as the in-process engine drives it, applies
exactly one step per call; a request naming an adapter that is not loaded is refused before it is scheduled, and
an adapter in use is not released."""

import asyncio

import pytest

from engine.core import EngineCore, _Outbox
from scheduler import EngineRequest, RequestError, RequestOutput, SamplingParams, Scheduler
from tests.scheduler.configs import scheduler_config
from workers.no_work import NoWorkRunner


def new_core(**kwargs) -> EngineCore:
    runner = NoWorkRunner(4096)

    async def execute(scheduler_output):
        return runner.execute_model(scheduler_output)

    scheduler = Scheduler(scheduler_config(64, block_size=4, max_num_seqs=8, max_loras=2), eos_token_id=None)
    return EngineCore(scheduler, execute, **kwargs)


def request(request_id: str, max_tokens: int, lora_name: str | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=params, lora_name=lora_name
    )


def test_the_loop_driven_step_by_step_applies_one_step_per_call():
    core = new_core()
    loop = asyncio.new_event_loop()
    core.add_request(request("a", 3), "sync")
    core.add_request(request("b", 5), "sync")
    tokens: dict[str, int] = {}
    while core.scheduler.has_unfinished_requests():
        before = core.scheduler.num_steps
        loop.run_until_complete(core.run(max_steps=1))
        assert core.scheduler.num_steps == before + 1
        for d in core.take_outputs("sync"):
            tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.new_token_ids)
    assert tokens == {"a": 3, "b": 5} and core.scheduler.num_steps == 5
    loop.run_until_complete(core.run(max_steps=1))  # nothing to run: it returns where the actor's loop would sleep
    assert core.scheduler.num_steps == 5 and core.take_outputs("sync") == []
    loop.close()


def test_an_adapter_not_loaded_is_refused_and_one_in_use_is_not_released():
    core = new_core(lora_names=("sql",))
    with pytest.raises(RequestError, match="no LoRA adapter of this name is loaded") as refused:
        core.add_request(request("x", 2, lora_name="chat"), "sync")
    assert refused.value.field == "model" and not core.scheduler.has_unfinished_requests()
    core.add_request(request("y", 2, lora_name="sql"), "sync")
    with pytest.raises(ValueError, match="have not finished"):
        core.release_adapter("sql")
    with pytest.raises(ValueError, match="already loaded"):
        core.check_new_adapter("sql")
    core.abort("y")
    core.release_adapter("sql")
    assert core.lora_names == set()


def delta(token: int) -> RequestOutput:
    return RequestOutput(request_id="r", index=0, new_token_ids=[token])


def test_nothing_to_send_until_a_delta_arrives():
    assert _Outbox().take(0) is None


def test_an_acknowledged_batch_is_not_sent_again():
    box = _Outbox()
    box.pending.append(delta(1))
    number, batch = box.take(0)
    assert (number, [d.new_token_ids for d in batch]) == (1, [[1]])
    assert box.take(number) is None
    box.pending.append(delta(2))
    assert [d.new_token_ids for d in box.take(number)[1]] == [[2]]


def test_a_batch_whose_caller_vanished_is_sent_again_with_what_came_since():
    box = _Outbox()
    box.pending.append(delta(1))
    box.take(0)  # taken by a call whose caller is gone: nobody acknowledges batch 1
    box.pending.append(delta(2))
    number, batch = box.take(0)
    assert number == 2 and [d.new_token_ids for d in batch] == [[1], [2]]
    number, batch = box.take(0)  # lost again: still everything, in order
    assert number == 3 and [d.new_token_ids for d in batch] == [[1], [2]]
    assert box.take(number) is None
