"""A rank's config as the engine makes it: WorkerConfig has no defaults of its own, EngineConfig fills it."""

from pathlib import Path

from engine.config import EngineConfig, derive_worker_config
from engine.interface import check_draft_model
from workers.model_loader import read_model_spec
from workers.worker import WorkerConfig


def worker_config(model: str, max_model_len: int = 2048, **engine_settings) -> WorkerConfig:
    """The specs read as the engine reads them; none where ``model`` is not a model directory (a test of what a
    rank does before it loads its model)."""
    engine = EngineConfig(**{"device": "cpu", **engine_settings})
    spec = draft_spec = None
    if (Path(model) / "config.json").is_file():
        spec = read_model_spec(model, engine.tensor_parallel_size, engine.enable_expert_parallel, engine.quantization)
        draft_spec = check_draft_model(engine, model, spec, max_model_len)
    return derive_worker_config(engine, model, max_model_len, model_spec=spec, draft_spec=draft_spec)
