"""The scheduler actor: the engine core's loop run on asyncio with ranks that answer from the no-work runner:
two steps in flight with async scheduling, one without, the same tokens either way, a request arriving mid-decode
joining the very next step, and a hung step failing every request."""

import asyncio
from types import SimpleNamespace

import pytest

from engine.scheduler_actor import SchedulerActor
from scheduler import EngineRequest, SamplingParams, unpack_outputs
from tests.scheduler.configs import scheduler_config
from workers.no_work import NoWorkRunner


class FakeRank:
    """A rank as the loop sees one (``execute_model.remote(step)``: an awaitable of its output), answering on the
    event loop's next turn from a no-work runner; from step ``hang_at`` on it never answers. ``first_steps`` is
    the step in which each request reached the rank."""

    def __init__(self, actor: SchedulerActor, hang_at: int | None = None) -> None:
        self.actor, self.hang_at = actor, hang_at
        self.runner = NoWorkRunner(4096)
        self.max_in_flight = 0
        self.first_steps: dict[str, int] = {}
        self.execute_model = SimpleNamespace(remote=self.remote)

    def remote(self, scheduler_output) -> asyncio.Future:
        self.max_in_flight = max(self.max_in_flight, len(self.actor.core.scheduler.in_flight))
        for new in scheduler_output.scheduled_new_reqs:
            self.first_steps[new.req_id] = scheduler_output.step_id
        future = asyncio.get_running_loop().create_future()
        if self.hang_at is None or scheduler_output.step_id < self.hang_at:
            asyncio.get_running_loop().call_soon(future.set_result, self.runner.execute_model(scheduler_output))
        return future


async def started_actor(async_scheduling: bool = True, hang_at: int | None = None) -> tuple[SchedulerActor, FakeRank]:
    actor = SchedulerActor([], eos_token_id=None)
    rank = FakeRank(actor, hang_at)
    actor.workers = [rank]
    config = scheduler_config(64, block_size=4, max_num_seqs=8, steps_in_flight=2 if async_scheduling else 1)
    await actor.start(config, step_timeout_s=0.5)
    return actor, rank


async def drive(async_scheduling: bool, hang_at: int | None = None) -> tuple[dict, SchedulerActor, FakeRank]:
    actor, rank = await started_actor(async_scheduling, hang_at)
    for i, n in enumerate((3, 9, 14)):
        await actor.add_request(
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=list(range(1, 4 + 5 * i)),
                sampling_params=SamplingParams(max_tokens=n, ignore_eos=True),
            )
        )
    got: dict = {}
    received = 0
    while len([1 for _, reason in got.values() if reason]) < 3:
        received, packed = await asyncio.wait_for(actor.get_outputs("sync", received), 5)
        batch = unpack_outputs(packed)
        for d in batch:
            tokens, _ = got.get(d.request_id, ([], None))
            got[d.request_id] = (tokens + d.new_token_ids, d.finish_reason)
    actor.loop_task.cancel()
    return got, actor, rank


def test_async_scheduling_keeps_two_steps_in_flight_and_gives_the_serial_tokens():
    serial, _, serial_rank = asyncio.run(drive(False))
    pipelined, actor, rank = asyncio.run(drive(True))
    assert (serial_rank.max_in_flight, rank.max_in_flight) == (1, 2)
    assert pipelined == serial and [len(t) for t, _ in serial.values()] == [3, 9, 14]
    assert actor.core.scheduler.in_flight == {}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_hung_step_fails_every_request_and_leaves_no_step_behind(async_scheduling):
    loop_errors = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda _, context: loop_errors.append(context))
        got, actor, _ = await drive(async_scheduling, hang_at=4)
        await asyncio.sleep(0.1)  # a dangling step's future would be collected and reported by now
        return got, actor

    got, actor = asyncio.run(scenario())
    assert [got[r][1] for r in ("r0", "r1", "r2")] == ["length", "error", "error"]  # r0 ended before step 4
    assert "step 4 got no reply" in actor.core.error
    assert loop_errors == []  # no future left with an exception nobody retrieved


def test_a_request_arriving_mid_decode_joins_the_very_next_step_and_finishes_first():
    async def scenario():
        actor, rank = await started_actor()
        await actor.add_request(
            EngineRequest(
                request_id="long",
                prompt_token_ids=[1, 2, 3],
                sampling_params=SamplingParams(max_tokens=40, ignore_eos=True),
            )
        )
        finished, received, num_tokens, arrival_step = [], 0, 0, None
        while len(finished) < 2:
            received, packed = await asyncio.wait_for(actor.get_outputs("sync", received), 5)
            batch = unpack_outputs(packed)
            for d in batch:
                if d.request_id == "long":
                    num_tokens += len(d.new_token_ids)
                if d.finished:
                    finished.append(d.request_id)
            if arrival_step is None and num_tokens >= 4:
                arrival_step = actor.core.scheduler.num_steps
                await actor.add_request(
                    EngineRequest(
                        request_id="late",
                        prompt_token_ids=[4, 5, 6, 7, 8],
                        sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
                    )
                )
        actor.loop_task.cancel()
        return rank.first_steps, arrival_step, finished

    first_steps, arrival_step, finished = asyncio.run(scenario())
    assert first_steps["long"] < arrival_step  # "late" arrived while "long" was decoding ...
    assert first_steps["late"] == arrival_step + 1  # ... ran in the step scheduled next ...
    assert finished == ["late", "long"]  # ... and was not held back until "long" was done
