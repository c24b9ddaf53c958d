"""The offline API's names, as vLLM's package gives them: ``from raylm import LLM, SamplingParams``.

Exports resolve lazily: a process that imports one name (the CLI's parser, a scheduler actor) must not drag
torch and the model stack in with the others.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "Completion": "engine.llm",
    "GenerateOutput": "engine.llm",
    "EmbeddingOutput": "engine.llm",
    "EngineConfig": "engine.config",
    "SamplingParams": "scheduler",
    "EngineRequest": "scheduler",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raylm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
