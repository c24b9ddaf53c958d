"""The LoRA adapters of one model's deployment, shared by all its replicas: a load or unload through any replica
reaches every replica's engine, and a replica that autoscaling starts later holds them all before it serves.

Why a deployment-scoped actor (Serve starts it with the deployment, shares it among the replicas and deletes it
with the app) and not Serve's model multiplexing: multiplexing loads a model on the replica a request lands on,
by a loader keyed by the model id alone, and evicts by LRU; vLLM's API loads an adapter by name *and path* at
run time and unloads it on request (a 400 while requests use it), which needs one place that knows the names and
paths and reaches every replica. Every engine holds every adapter in host memory (megabytes each); which are on
the device is each engine's LRU of slots, refilled by a copy, so preferring replicas that hold an adapter on the
device (multiplexed routing) would save a slot copy at the price of load balance and of the prefix-cache router's
choice. HTTP reaches the replicas through HAProxy and that router, which multiplexed ids would bypass anyway.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig

from engine.client import EngineAdapters

NAME = "lora_registry"


def registry_config(adapters: dict[str, str]) -> DeploymentActorConfig:
    """The deployment option that gives a deployment its registry, knowing the adapters its engines load at
    start (``lora_modules``)."""
    return DeploymentActorConfig(
        name=NAME, actor_class=LoraRegistry, init_args=(adapters,), actor_options={"num_cpus": 0}
    )


async def registry() -> Any:
    """This replica's deployment's registry (the controller may still be starting it)."""
    for _ in range(100):
        try:
            return serve.get_deployment_actor(NAME)
        except ValueError:
            await asyncio.sleep(0.1)
    return serve.get_deployment_actor(NAME)


def _refusal(e: BaseException) -> str:
    """The ValueError's message inside Ray's error (an engine refused the adapter)."""
    cause = getattr(e, "cause", None) or e
    return str(cause).strip().splitlines()[-1].removeprefix("ValueError: ")


@ray.remote
class LoraRegistry:
    """``adapters``: every adapter of the deployment (name -> path), those of ``lora_modules`` first; ``engines``:
    each live replica's engine (its client's EngineAdapters), every one holding exactly ``adapters``. One change at
    a time (``lock``), each reaching every engine or, when one refuses, none (the others are put back); an engine
    whose actor died leaves. State lives here only: a registry the controller restarts knows the start-up adapters."""

    def __init__(self, adapters: dict[str, str]) -> None:
        self.adapters = dict(adapters)
        self.engines: dict[str, EngineAdapters] = {}
        self.lock = asyncio.Lock()

    async def join(self, replica: str, engine: EngineAdapters) -> dict[str, str]:
        """A replica's engine, which holds the start-up adapters: made to hold exactly ``adapters`` (some may have
        been unloaded, others loaded, at run time); from now on every change reaches it."""
        async with self.lock:
            held = set(await engine.lora_names())
            for name in held - self.adapters.keys():
                await engine.remove_lora(name)
            for name in self.adapters.keys() - held:
                await engine.add_lora(name, self.adapters[name])
            self.engines[replica] = engine
            return dict(self.adapters)

    async def listed(self) -> dict[str, str]:
        return dict(self.adapters)

    async def load(self, name: str, path: str) -> str | None:
        """Load into every engine; the refusal (naming the adapter and the mismatch) when one refuses."""
        async with self.lock:
            if name in self.adapters:
                return f"the LoRA adapter {name!r} is already loaded"
            done, refusal = await self._each("add_lora", name, path)
            if refusal is not None:
                await self._each("remove_lora", name, replicas=done)
                return refusal
            self.adapters[name] = path
            return None

    async def unload(self, name: str) -> str | None:
        """Unload from every engine; the refusal when it is absent or requests on some replica still use it."""
        async with self.lock:
            if name not in self.adapters:
                return f"the LoRA adapter {name!r} is not loaded"
            done, refusal = await self._each("remove_lora", name)
            if refusal is not None:
                await self._each("add_lora", name, self.adapters[name], replicas=done)
                return refusal
            del self.adapters[name]
            return None

    async def _each(self, method: str, *args: Any, replicas: list[str] | None = None) -> tuple[list[str], str | None]:
        """``method`` on every engine (or on ``replicas``' engines) at once: the replicas where it succeeded, and
        the first refusal."""
        replicas = list(self.engines) if replicas is None else replicas
        results = await asyncio.gather(
            *(getattr(self.engines[r], method)(*args) for r in replicas), return_exceptions=True
        )
        done, refusal = [], None
        for replica, result in zip(replicas, results):
            if isinstance(result, ray.exceptions.RayActorError):  # the replica is gone, its engine with it
                del self.engines[replica]
            elif isinstance(result, BaseException):
                refusal = refusal or _refusal(result)
            else:
                done.append(replica)
        return done, refusal
