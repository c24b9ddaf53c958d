"""Assembly: configs, engines, the offline LLM API, the Serve app and the CLI.

Exports resolve lazily: the scheduler actor imports `cluster.scheduler_actor`,
and importing this package must not drag torch into that process.
"""

import importlib

_EXPORTS = {
    "LLM": "cluster.llm",
    "Completion": "cluster.llm",
    "GenerateOutput": "cluster.llm",
    "EmbeddingOutput": "cluster.llm",
    "EngineConfig": "cluster.config",
    "SamplingParams": "scheduler",
    "EngineRequest": "scheduler",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
