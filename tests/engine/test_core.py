"""The engine core (engine/core.py) without a transport: an outbox keeps a batch until its caller
acknowledges it, so a call that returns to a caller who is gone (a pump cancelled too late) loses nothing and a
received batch never repeats; the loop driven one step at a time, as the in-process engine drives it, applies
exactly one step per call; a request naming an adapter that is not loaded is refused before it is scheduled, and
an adapter in use is not released. The gate (issue #71) with the loop in the background, as the scheduler actor
runs it: pause in each mode, requests held while paused or asleep and served after, sleep refused with live
requests, updates run with no step in flight and reset the prefix cache."""

import asyncio
from collections import defaultdict

import pytest

from engine.core import EngineCore, _Outbox
from scheduler import EngineRequest, RequestError, RequestOutput, SamplingParams, Scheduler
from tests.scheduler.configs import scheduler_config
from workers.no_work import NoWorkRunner


def new_core(step_s: float = 0.0, **kwargs) -> EngineCore:
    runner = NoWorkRunner(4096)

    async def execute(scheduler_output):
        await asyncio.sleep(step_s)  # a step's round trip: the loop yields to the callers meanwhile
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


# ---- the gate, with the loop in the background (the scheduler actor's) ---------------------------------------


async def background(core: EngineCore, test) -> None:
    """Run ``test(core, tokens)`` beside the core's loop; ``tokens()`` gathers the channel's deltas so far as
    {request id: [token count, finish reason]}."""
    got: dict[str, list] = defaultdict(lambda: [0, None])

    def tokens() -> dict[str, list]:
        for d in core.take_outputs("c"):
            got[d.request_id][0] += len(d.new_token_ids)
            got[d.request_id][1] = d.finish_reason or got[d.request_id][1]
        return dict(got)

    loop = asyncio.create_task(core.run())
    try:
        await asyncio.wait_for(test(core, tokens), 10)
    finally:
        loop.cancel()


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.002)


def test_pause_keep_freezes_the_live_requests_and_resume_finishes_them():
    async def test(core, tokens):
        for rid in "ab":
            core.add_request(request(rid, 40), "c")
        await until(lambda: tokens().get("a", [0])[0] >= 3)
        assert await core.pause_generation("keep") == 0 and not core.in_flight
        frozen, steps = tokens(), core.scheduler.num_steps
        core.add_request(request("late", 4), "c")  # held, not lost
        await asyncio.sleep(0.05)
        assert tokens() == frozen and core.scheduler.num_steps == steps and core.stats().num_waiting == 1
        core.resume_generation()
        await until(lambda: all(tokens().get(r, [0, None])[1] for r in ("a", "b", "late")))
        assert tokens() == {"a": [40, "length"], "b": [40, "length"], "late": [4, "length"]}

    asyncio.run(background(new_core(step_s=0.002), test))


def test_pause_abort_ends_every_live_request_and_frees_its_blocks():
    async def test(core, tokens):
        core.add_request(request("a", 40), "c")
        await until(lambda: tokens().get("a", [0])[0] >= 2)
        assert await core.pause_generation("keep") == 0
        core.add_request(request("held", 4), "c")
        assert await core.pause_generation("abort") == 2  # the frozen one and the held one
        assert tokens()["a"][1] == "abort" and tokens()["held"] == [0, "abort"]
        assert core.stats().kv_cache_usage == 0 and not core.has_unfinished_requests() and not core.streams
        core.add_request(request("after", 3), "c")  # held until the resume, then served
        core.resume_generation()
        await until(lambda: tokens().get("after", [0, None])[1])
        assert tokens()["after"] == [3, "length"]

    asyncio.run(background(new_core(step_s=0.002), test))


def test_pause_wait_finishes_the_live_requests_and_holds_new_ones():
    async def test(core, tokens):
        core.add_request(request("a", 30), "c")
        await until(lambda: tokens().get("a", [0])[0] >= 2)
        pausing = asyncio.ensure_future(core.pause_generation("wait"))
        await asyncio.sleep(0.01)
        core.add_request(request("new", 3), "c")
        assert await pausing == 0
        assert tokens()["a"] == [30, "length"] and "new" not in tokens() and core.stats().num_waiting == 1
        core.resume_generation()
        await until(lambda: tokens().get("new", [0, None])[1])
        assert tokens()["new"] == [3, "length"]

    asyncio.run(background(new_core(step_s=0.002), test))


def test_sleep_refuses_live_requests_and_holds_new_ones_until_wake():
    async def asleep(state: list) -> None:
        state.append("slept")

    async def test(core, tokens):
        core.add_request(request("a", 30), "c")
        with pytest.raises(ValueError, match="1 live request"):
            await core.sleep(lambda: asleep([]))
        await until(lambda: tokens().get("a", [0, None])[1])
        state: list = []
        await core.sleep(lambda: asleep(state))
        assert state == ["slept"] and core.asleep
        core.add_request(request("b", 3), "c")
        await asyncio.sleep(0.02)
        assert "b" not in tokens() and core.stats().num_waiting == 1

        async def restore() -> bool:
            return False  # nothing sleeps any longer

        await core.wake_up(restore)
        await until(lambda: tokens().get("b", [0, None])[1])
        assert tokens()["b"] == [3, "length"]

    asyncio.run(background(new_core(step_s=0.002), test))


def test_an_update_runs_with_no_step_in_flight_and_forgets_the_prefix_cache():
    async def test(core, tokens):
        core.add_request(request("warm", 2), "c")  # its prompt's full block enters the prefix cache
        await until(lambda: tokens().get("warm", [0, None])[1])
        core.add_request(request("a", 40), "c")
        await until(lambda: tokens().get("a", [0])[0] >= 2)
        seen = []

        async def update() -> None:
            seen.append((len(core.in_flight), bool(core.scheduler.kv.block_pool.cached_blocks)))

        await core.update_weights(update, flush_cache=True, weight_version="v1")
        assert seen == [(0, True)] and not core.scheduler.kv.block_pool.cached_blocks
        assert core.stats().weight_version == "v1"

        async def refused() -> None:
            raise ValueError("model.embed_tokens.weight: shape (1, 2) is not (3, 4)")

        with pytest.raises(ValueError, match="embed_tokens"):
            await core.update_weights(refused, flush_cache=True, weight_version="v2")
        assert core.weight_version == "v1"
        await until(lambda: tokens().get("a", [0, None])[1])  # the gate reopened: it ran on to the end
        assert tokens()["a"] == [40, "length"]

    asyncio.run(background(new_core(step_s=0.002), test))
