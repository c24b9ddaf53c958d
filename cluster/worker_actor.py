"""The worker actor: a Worker behind a class whose module imports no torch.

Unpickling an actor handle imports its class's module (Ray rebuilds the
method table from the class), and the scheduler actor holds every rank's
handle. Were the handles typed ``Worker``, the torch-free scheduler process
would import torch and the whole model stack; so the actor class lives here
and imports workers/ only in its constructor, inside the rank's process.
"""

from __future__ import annotations

from typing import Any


class WorkerActor:
    """One tensor-parallel rank: owns its Worker (model shard and KV cache) for the actor's lifetime."""

    def __init__(self, config: Any, rank: int) -> None:
        import ray

        from workers.worker import Worker

        # The GPU ids Ray assigned this actor choose its device (workers.worker.cuda_index).
        self.worker = Worker(config, rank, gpu_ids=ray.get_gpu_ids())

    def execute_model(self, scheduler_output: Any) -> Any:
        """The hot path: one step; rank 0 returns the sampled tokens, the others None."""
        return self.worker.execute_model(scheduler_output)

    def check_health(self) -> bool:
        return self.worker.check_health()

    def call(self, method: str, *args: Any) -> Any:
        """Any other Worker method, by name: start-up steps, run once per engine."""
        return getattr(self.worker, method)(*args)
