"""The worker actor: a Worker behind a class whose module imports no torch.

Unpickling an actor handle imports its class's module (Ray rebuilds the
method table from the class), and the scheduler actor holds every rank's
handle. Were the handles typed ``Worker``, the torch-free scheduler process
would import torch and the whole model stack; so the actor class lives here
and imports workers/ only in its constructor, inside the rank's process.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any


def node_gpu_lists(node_ids: Sequence[str], gpu_ids: Sequence[Sequence[int | str]]) -> list[str]:
    """Per rank, the CUDA_VISIBLE_DEVICES naming every GPU the engine's ranks hold on that rank's node: Ray's
    ids of the node's ranks, in order (numerically where they are numbers, as Ray numbers them)."""
    per_node: dict[str, set[str]] = {}
    for node, ids in zip(node_ids, gpu_ids):
        per_node.setdefault(node, set()).update(str(i) for i in ids)
    return [",".join(sorted(per_node[node], key=_gpu_order)) for node in node_ids]


def _gpu_order(gpu_id: str) -> tuple[int, int, str]:
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def share_node_gpus(workers: list, node_ids: Sequence[str]) -> None:
    """Let every rank see all the GPUs the engine holds on its node, not only its own, before any rank
    touches CUDA. Ray masks each actor to its one GPU, and NCCL between ranks that cannot see each other's
    devices loses P2P/NVLink (it falls back to shared memory through the host) and has hung on NVSwitch nodes
    (ray-project/ray#16979). Each rank then picks its own GPU by its position in the list (cuda_index). Each
    rank also learns how many ranks share its host's memory (each pins its own host tier)."""
    import ray

    gpu_ids = ray.get([w.gpu_ids.remote() for w in workers])
    lists = node_gpu_lists(node_ids, gpu_ids)
    ranks_on_node = {node: list(node_ids).count(node) for node in node_ids}
    ray.get(
        [w.see_node_gpus.remote(visible, ranks_on_node[node]) for w, visible, node in zip(workers, lists, node_ids)]
    )


# The concurrency group that reads LoRA adapters: an adapter loaded at run time is read (safetensors from disk,
# checked, converted) on this thread while steps run on the actor's default one, so the streams running stall for
# no disk read; nothing reads the adapter until every rank has it (the scheduler actor admits requests for it
# only then), and the step that first uses it copies it into its slots.
LORA_READS = "lora_reads"
# The concurrency group that fetches a request's transferred KV (prefill/decode disaggregation) while steps run: the
# fetch is a network copy, and the request is queued only once every rank holds its part (SchedulerActor).
KV_TRANSFERS = "kv_transfers"


class WorkerActor:
    """One tensor-parallel rank: owns its Worker (model shard and KV cache) for the actor's lifetime. Methods run
    one at a time on the actor's thread, in the order called, but ``call`` dispatched to ``LORA_READS`` and
    ``stage_kv`` to ``KV_TRANSFERS``."""

    def __init__(self, rank: int) -> None:
        # The model stack's import is most of a rank's start: done here, while the engine that started the rank
        # may still be reading the checkpoints its configuration comes from.
        import workers.worker  # noqa: F401

        self.rank = rank

    def configure(self, config: Any) -> None:
        import ray

        from workers.worker import Worker

        # The GPU ids Ray assigned this actor choose its device (workers.worker.cuda_index).
        self.worker = Worker(config, self.rank, gpu_ids=ray.get_gpu_ids())

    def gpu_ids(self) -> list[int | str]:
        return self.worker.gpu_ids

    def see_node_gpus(self, visible_devices: str, ranks_on_node: int) -> None:
        """Before init_device: CUDA reads CUDA_VISIBLE_DEVICES once, when the process first initialises it."""
        if visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        self.worker.ranks_on_host = ranks_on_node

    def execute_model(self, scheduler_output: Any) -> Any:
        """The hot path: one step; rank 0 returns the sampled tokens, the others None. A step that exports KV
        (``kv_exports``) returns (that, {request id: KVPart}): this rank's share, put in the object store once."""
        return self._reply(scheduler_output, self.worker.execute_model(scheduler_output))

    def _reply(self, scheduler_output: Any, out: Any) -> Any:
        import ray

        from scheduler import KVPart

        if not scheduler_output.kv_exports:
            return out
        head_start, num_heads = self.worker.kv_heads()
        exported = self.worker.take_kv_exports()
        return out, {
            rid: KVPart(head_start=head_start, num_heads=num_heads, data=ray.put(blocks))
            for rid, blocks in exported.items()
        }

    def stage_kv(self, req_id: str, parts: list) -> int:
        """Fetch this rank's heads of a request's transferred KV (only the parts that hold them, each head from
        one) and keep them until the step that admits the request (Worker.stage_kv); returns the bytes fetched."""
        import ray

        start, num = self.worker.kv_heads()
        needed = []
        for head in range(start, start + num):
            if not any(p.head_start <= head < p.head_start + p.num_heads for p in needed):
                needed += [p for p in parts if p.head_start <= head < p.head_start + p.num_heads][:1]
        arrays = ray.get([p.data for p in needed])
        self.worker.stage_kv(req_id, [(p.head_start, a) for p, a in zip(needed, arrays)])
        return sum(a.nbytes for a in arrays)

    def drop_staged_kv(self, req_id: str) -> None:
        self.worker.drop_staged_kv(req_id)

    def check_health(self) -> bool:
        return self.worker.check_health()

    def call(self, method: str, *args: Any) -> Any:
        """Any other Worker method, by name: start-up steps, run once per engine."""
        return getattr(self.worker, method)(*args)


class OverlappingWorkerActor(WorkerActor):
    """A rank whose steps overlap, for async scheduling with one pipeline stage: ``execute_model`` launches its
    step on the device and yields while the device runs it (PendingStep.wait), so the next step (already sent: the
    scheduler keeps two in flight) is built and launched before this one's sampled ids reach the host
    (ModelRunner.launch).

    Invariants: steps are launched in step-id order, each once, starting at 1 (every step the scheduler makes is
    sent to every rank), and finished in that order (the runner's rule): Ray runs an async actor's calls
    concurrently on one event loop and does not promise to start them in the order sent (an argument held in the
    object store may resolve late), so a step waits for its predecessor's launch. The other methods run as in
    WorkerActor, on the event loop's thread (or their concurrency group's).
    """

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.launched = 0  # the id of the last step launched
        self.turn: asyncio.Condition | None = None  # made on the actor's event loop, at the first step

    async def execute_model(self, scheduler_output: Any) -> Any:
        so = scheduler_output
        if self.turn is None:
            self.turn = asyncio.Condition()
        async with self.turn:
            await self.turn.wait_for(lambda: so.step_id == self.launched + 1)
            try:
                pending = self.worker.launch(so)
            finally:  # a failed launch fails the engine; the steps after it must not wait forever meanwhile
                self.launched = so.step_id
                self.turn.notify_all()
        await pending.wait()
        return self._reply(so, self.worker.finish(pending))
