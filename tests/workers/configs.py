"""A rank's config as the engine makes it: WorkerConfig has no defaults of its own, EngineConfig fills it."""

from cluster.config import EngineConfig, derive_worker_config
from workers.worker import WorkerConfig


def worker_config(model: str, max_model_len: int = 2048, **engine_settings) -> WorkerConfig:
    return derive_worker_config(EngineConfig(**{"device": "cpu", **engine_settings}), model, max_model_len)
