"""Which GPUs each rank sees: every GPU the engine holds on its node (NCCL needs them for P2P/NVLink); an
overlapping rank's steps, without Ray."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from engine.worker_actor import OverlappingWorkerActor, node_gpu_lists


@pytest.mark.parametrize(
    "node_ids,gpu_ids,expected",
    [
        (["a", "a"], [[1], [0]], ["0,1", "0,1"]),  # one node: both ranks see both GPUs
        (["a", "b", "a", "b"], [[3], [0], [2], [1]], ["2,3", "0,1", "2,3", "0,1"]),  # two nodes, two ranks each
        (["a", "a"], [[10], [9]], ["9,10", "9,10"]),  # numerically, not as text
        (["a", "a"], [["GPU-b"], ["GPU-a"]], ["GPU-a,GPU-b"] * 2),  # UUIDs, as some clusters name them
        (["a", "a"], [[], []], ["", ""]),  # CPU ranks: nothing to set
    ],
)
def test_each_rank_sees_every_gpu_of_its_node(node_ids, gpu_ids, expected):
    assert node_gpu_lists(node_ids, gpu_ids) == expected


class StepOneCopy:
    """Step 1's copy event, done once step 2 is launched (a device a step behind)."""

    def __init__(self):
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(5), "step 1 was waited for on the event loop's thread: step 2 could not launch"


class OverlappingWorker:
    """A Worker's launch and finish: step 1 not ready until step 2 is launched; every later step ready at once."""

    def __init__(self):
        self.copy, self.launched = StepOneCopy(), []

    def launch(self, so):
        from workers.runner_inputs import PendingStep

        self.launched.append(so.step_id)
        if so.step_id == 2:
            self.copy.done.set()
        copied = self.copy if so.step_id == 1 else None
        return PendingStep([], sampled=torch.zeros(1, dtype=torch.int64), copied=copied, output=f"step {so.step_id}")

    def finish(self, pending):
        return pending.output


def test_an_overlapping_rank_launches_the_next_step_while_it_waits_for_one():
    """The rank awaits a launched step (PendingStep.wait) with its event loop free: step 2 (sent first, launched
    second) is launched while step 1's ids are on their way, and each step replies with its own output."""
    actor = OverlappingWorkerActor(0)
    actor.worker = OverlappingWorker()

    async def steps():
        step = [SimpleNamespace(step_id=i, kv_exports=None) for i in (1, 2)]
        return await asyncio.wait_for(asyncio.gather(actor.execute_model(step[1]), actor.execute_model(step[0])), 10)

    assert asyncio.run(steps()) == ["step 2", "step 1"]
    assert actor.worker.launched == [1, 2]
