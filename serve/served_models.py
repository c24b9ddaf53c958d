"""The names one replica answers to: its base model's and its deployment's LoRA adapters', with their model cards
and the run-time loads and unloads of adapters."""

from __future__ import annotations

from typing import Any

from engine.client import EngineAdapters
from scheduler import RequestError
from serve.lora_registry import registry
from serve.protocol.models import ModelCard
from serve.protocol.parsing import APIError, bad_request


class ServedModels:
    """The base model's name and the deployment's adapters (name -> path) as this replica last saw them.

    The registry (lora_registry.py) knows the adapters of every replica, and every replica's engine holds them all;
    ``lora_paths`` is this replica's copy, refreshed from the registry when a name is not in it, so an adapter
    loaded through another replica is found, and one unloaded there is a 404 here (``unloaded``). Without
    enable_lora there is no registry and the adapters are those loaded at start.
    """

    def __init__(
        self, model_name: str, model_path: str, max_model_len: int, lora_paths: dict[str, str], created: int
    ) -> None:
        self.model_name = model_name
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora_paths = dict(lora_paths)
        self.created = created
        self.lora_registry: Any = None

    async def join(self, replica_id: str, adapters: EngineAdapters) -> None:
        """Register this replica's engine with the deployment's registry, which brings it every adapter loaded
        at run time so far; before the replica serves."""
        self.lora_registry = await registry()
        self.lora_paths = await self.lora_registry.join.remote(replica_id, adapters)

    async def names(self) -> dict[str, str]:
        """The deployment's adapters now: loads and unloads through other replicas included."""
        if self.lora_registry is not None:
            self.lora_paths = await self.lora_registry.listed.remote()
        return self.lora_paths

    async def check(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model), or 404 naming the known ones."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_paths or model in await self.names():
            return model
        served = repr(self.model_name) + "".join(f", {n!r}" for n in sorted(self.lora_paths))
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {served}", "model", "model_not_found"
        )

    async def unloaded(self, e: RequestError) -> APIError | None:
        """The 404 for a request naming an adapter that another replica unloaded since this one last looked."""
        if e.field != "model" or self.lora_registry is None:
            return None
        self.lora_paths.pop(e.value, None)
        try:
            await self.check(e.value)
        except APIError as gone:
            return gone
        return None

    def card(self, lora_name: str | None = None) -> ModelCard:
        if lora_name is not None:
            root, parent = self.lora_paths[lora_name], self.model_name
        else:
            root, parent = self.model_path, None
        return ModelCard(
            id=lora_name or self.model_name,
            created=self.created,
            root=root,
            parent=parent,
            max_model_len=self.max_model_len,
        )

    async def cards(self) -> list[ModelCard]:
        return [self.card(), *(self.card(name) for name in sorted(await self.names()))]

    async def load(self, name: str, path: str) -> None:
        """Load adapter ``name`` into every replica's engine; 400 naming it when the name is taken or it does not
        fit the model."""
        if name == self.model_name:
            raise bad_request(f"the LoRA adapter {name!r} names the base model", "lora_name")
        refusal = await self._registry().load.remote(name, path)
        if refusal is not None:
            raise bad_request(refusal, "lora_name" if "already loaded" in refusal else "lora_path")
        self.lora_paths[name] = path

    async def unload(self, name: str) -> None:
        """Unload adapter ``name`` from every replica's engine; 400 naming it when it is absent or requests on some
        replica still run with it."""
        refusal = await self._registry().unload.remote(name)
        if refusal is not None:
            raise bad_request(refusal, "lora_name")
        self.lora_paths.pop(name, None)

    def _registry(self) -> Any:
        if self.lora_registry is None:
            raise bad_request("LoRA is not enabled on this server: serve it with enable_lora", "lora_path")
        return self.lora_registry
