"""The LoRA adapters of a Ray engine, as its client reaches them: from the engine's own process (RayEngine) or from
another one that holds this object (the deployment's LoRA registry, serve/lora_registry.py). Imports no
torch and no Ray: the registry's process unpickles it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class EngineAdapters:
    """The adapter calls of one engine's scheduler actor (``actor``, a picklable handle), each returning the call's
    ObjectRef: ``ray.get`` it, or await it. A refusal is the actor's ValueError naming the adapter, inside Ray's
    error; the set of names lives in the engine core alone (EngineCore.lora_names)."""

    actor: Any

    def lora_names(self) -> Any:
        return self.actor.list_loras.remote()

    def add_lora(self, name: str, path: str) -> Any:
        return self.actor.add_lora.remote(name, path)

    def remove_lora(self, name: str) -> Any:
        return self.actor.remove_lora.remote(name)
