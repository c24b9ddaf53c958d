"""Async scheduling: step N+1 is scheduled before step N's output is applied (two steps in flight), with the
samples of steps in flight counted as placeholders. The fake worker runs each step as it is scheduled, in
order, and appends its own samples, as the ranks do."""

from collections import deque

from scheduler import EngineRequest, RequestStatus, SchedulerOutput
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.test_host_tier import make as make_tiered
from tests.scheduler.test_scheduler import EOS, make, params, run_all


class Pipeline:
    """The Ray engine loop's order: schedule and send a step, then apply the oldest once two are in flight."""

    def __init__(self, sched, worker: FakeWorker) -> None:
        self.sched, self.worker = sched, worker
        self.pending: deque = deque()
        self.got: dict[tuple[str, int], list] = {}

    def send(self) -> SchedulerOutput:
        so = self.sched.schedule()
        self.pending.append((so, self.worker.execute(so)))
        return so

    def apply(self) -> list:
        so, out = self.pending.popleft()
        outs = self.sched.update_from_output(so, out)
        for o in outs:
            entry = self.got.setdefault((o.request_id, o.index), [[], None])
            entry[0].extend(o.new_token_ids)
            if o.finished:
                entry[1] = o.finish_reason
        return outs

    def run(self, max_steps: int = 1000) -> dict[tuple[str, int], list]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                while self.pending:
                    self.apply()
                return self.got
            self.send()
            if len(self.pending) == 2:
                self.apply()
        raise AssertionError("requests never finished")


def serial(prompts: dict[str, list[int]], **kw) -> dict[tuple[str, int], list]:
    sched, worker = make(num_blocks=64)
    for rid, prompt in prompts.items():
        sched.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params(**kw)))
    return run_all(sched, worker)


def test_the_second_plan_computes_each_sampled_position_before_the_first_is_applied():
    sched, worker = make()
    prompts = {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9]}
    for rid, prompt in prompts.items():
        sched.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params(max_tokens=6)))
    pipe = Pipeline(sched, worker)
    pipe.send()
    second = pipe.send()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [6, 3]  # the positions of step 1's samples
    a, b = sched.requests["a"], sched.requests["b"]
    assert (a.num_output_placeholders, b.num_output_placeholders, a.num_tokens) == (2, 2, 6)
    pipe.apply()
    assert (a.num_output_placeholders, a.output_token_ids) == (1, [worker.states["a"].token_ids[6]])
    assert pipe.run() == serial(prompts, max_tokens=6)
    assert sched.in_flight == {} and sched.schedule().finished_req_ids == {"a", "b"}


def test_a_request_is_not_scheduled_past_max_tokens():
    sched, worker = make()
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=params(max_tokens=2)))
    pipe = Pipeline(sched, worker)
    pipe.send()
    pipe.send()  # samples the second and last token
    assert pipe.send().num_scheduled_tokens == {}  # no third step for it
    pipe.apply()
    assert pipe.apply()[0].finish_reason == "length"
    assert len(worker.states["a"].token_ids) == 5  # the workers sampled exactly two tokens
    assert pipe.run() == {("a", 0): [worker.states["a"].token_ids[3:], "length"]}


def test_a_token_sampled_after_eos_in_flight_is_dropped():
    sched, _ = make()
    worker = FakeWorker(4, 64, eos_token_id=EOS, eos_every=6)  # the token at length 6 is EOS
    sched.add_request(
        EngineRequest(
            request_id="a", prompt_token_ids=[1, 2, 3, 4, 5, 6], sampling_params=params(max_tokens=8, ignore_eos=False)
        )
    )
    pipe = Pipeline(sched, worker)
    pipe.send()
    pipe.send()  # wasted: it samples past the EOS it cannot know of yet
    assert [(o.new_token_ids, o.finish_reason) for o in pipe.apply()] == [([EOS], "stop")]
    assert len(worker.states["a"].token_ids) == 8 and pipe.apply() == []
    assert sched.schedule().finished_req_ids == {"a"} and sched.kv.block_pool.num_free_blocks == 63


def test_a_stale_step_never_touches_a_new_request_reusing_the_id():
    sched, worker = make()
    sched.add_request(
        EngineRequest(request_id="a", prompt_token_ids=[1, 2, 3, 4], sampling_params=params(max_tokens=10))
    )
    pipe = Pipeline(sched, worker)
    pipe.send()
    pipe.send()  # both steps sample the old "a"
    old = sched.requests["a"]
    sched.abort("a")
    sched.add_request(EngineRequest(request_id="a", prompt_token_ids=[9, 8, 7], sampling_params=params(max_tokens=3)))
    pipe.apply()
    so = pipe.send()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"] and so.finished_req_ids == {"a"}
    new = sched.requests["a"]
    assert pipe.apply() == []  # step 2's token was the old request's
    assert (new.output_token_ids, new.num_output_placeholders, old.output_token_ids) == ([], 1, [])
    got = pipe.run()
    assert got == {("a", 0): serial({"a": [9, 8, 7]}, max_tokens=3)[("a", 0)]}


def test_a_request_preempted_with_a_step_in_flight_keeps_its_token_and_resumes():
    prompts = {"a": [1] * 7, "b": [2] * 7}
    for swap in (False, True):  # 4 usable blocks: a and b fill them after their prefills
        sched, worker = make_tiered(num_blocks=5, preemption_mode="swap") if swap else make(num_blocks=5)
        for rid, prompt in prompts.items():
            sched.add_request(
                EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params(max_tokens=6))
            )
        pipe = Pipeline(sched, worker)
        pipe.send()
        pipe.send()  # position 7 fits both second blocks: both sample again
        pipe.apply()
        b = sched.requests["b"]
        assert pipe.send().preempted_req_ids == {"b"}  # a needs a third block: b goes, its step 2 in flight
        assert b.num_output_placeholders == 1 and len(b.output_token_ids) == 1
        pipe.apply()
        assert b.status == RequestStatus.PREEMPTED and len(b.output_token_ids) == 2
        assert b.num_output_placeholders == 0 and (b in sched.swapped) == swap
        assert pipe.run() == serial(prompts, max_tokens=6)


def test_a_block_is_cached_as_soon_as_its_last_token_is_known():
    sched, worker = make()
    sched.add_request(
        EngineRequest(request_id="a", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7], sampling_params=params(max_tokens=4))
    )
    pipe = Pipeline(sched, worker)
    pipe.send()
    pipe.send()  # computes position 7, whose token step 1 sampled
    pipe.apply()  # that token completes block 1's ids, and its position is scheduled: cached now, not a step later
    assert sched.kv.num_cached_blocks["a"] == 2
    sched.add_request(
        EngineRequest(
            request_id="b",
            prompt_token_ids=worker.states["a"].token_ids[:8] + [5],
            sampling_params=params(max_tokens=1),
        )
    )
    pipe.send()
    assert sched.requests["b"].num_cached_tokens == 8  # both blocks; the fake checks they hold a's tokens
    pipe.apply()
    assert set(pipe.run()) == {("a", 0), ("b", 0)}
