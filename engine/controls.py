"""The RL rollout controls (issue #71) of an engine whose core is in this process: sleep and wake-up, pause and
resume, weight updates and the prefix cache, written once for the in-process engine and the scheduler actor.

Imports no torch and no ray: the scheduler actor's process runs it (a tensor crosses it only inside an ObjectRef).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Awaitable, Callable
from typing import Any

from engine.core import EngineCore


class EngineControls:
    """The async controls of client.EngineClient over ``core`` and ``on_ranks`` (every rank's reply to a Worker
    method, in rank order), a mixin of InProcessEngine and SchedulerActor; RayEngine forwards each to its scheduler
    actor.

    Invariants: what changes a rank's weights or KV (sleep, wake-up, updates, the weight-update group) runs
    through ``core.exclusive``, so no step is in flight meanwhile and every rank takes the calls in one order;
    what only reads the core answers at once. ``update_weights_from_distributed`` sends the call to every rank
    before awaiting any (``on_ranks`` gathers), since all of them must join the trainer's one broadcast.
    """

    core: EngineCore
    on_ranks: Callable[..., Awaitable[list]]  # (method, *args): the executor's

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Each executor gets its own copy of these functions: Ray's tracing writes a ``__signature__`` (with a
        # ``_ray_trace_ctx`` parameter) onto the function of every method of an actor class (SchedulerActor's),
        # which would otherwise show on the in-process engine's methods too.
        super().__init_subclass__(**kwargs)
        for name, function in vars(EngineControls).items():
            # Only where the class would inherit this very function: not over an override, nor again on a class
            # Ray derives from the actor class.
            if inspect.isfunction(function) and getattr(cls, name) is function and name != "__init_subclass__":
                setattr(cls, name, _copy(function))

    async def sleep(self, level: int = 1) -> None:
        """Release every rank's KV cache (level 1) or its KV cache and weights (level 2)."""
        await self.core.sleep(lambda: self.on_ranks("sleep", level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore "weights", "kv_cache" or (None) both."""

        async def restore() -> bool:
            await self.on_ranks("wake_up", tags)
            return any(await self.on_ranks("is_sleeping"))

        await self.core.wake_up(restore)

    async def is_sleeping(self) -> bool:
        return self.core.asleep

    async def pause_generation(self, mode: str = "abort") -> int:
        """Stop stepping: "abort" ends the live requests (returns how many), "wait" lets them finish, "keep"
        freezes them."""
        return await self.core.pause_generation(mode)

    async def resume_generation(self) -> None:
        self.core.resume_generation()

    async def is_paused(self) -> bool:
        return self.core.paused

    async def reset_prefix_cache(self) -> bool:
        return self.core.scheduler.reset_prefix_cache()

    async def get_weight_version(self) -> str:
        """ "default" until an update names a version."""
        return self.core.weight_version

    async def update_weights_from_tensor(
        self, named_tensors: Any, flush_cache: bool = True, weight_version: str | None = None
    ) -> None:
        """Hugging Face names and full tensors, a list of (name, tensor) (on Ray also an ObjectRef of one)."""
        await self._update(flush_cache, weight_version, "update_weights", named_tensors)

    async def update_weights_from_disk(
        self, model_path: str, flush_cache: bool = True, weight_version: str | None = None
    ) -> None:
        """Every tensor of the checkpoint directory ``model_path``."""
        await self._update(flush_cache, weight_version, "update_weights_from_disk", model_path)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "raylm",
        backend: str | None = None,
    ) -> None:
        """Every rank joins ``group_name`` as rank rank_offset + its rank; the trainer is rank 0."""
        args = (master_address, master_port, rank_offset, world_size, group_name, backend)
        await self.core.exclusive(lambda: self.on_ranks("init_weights_update_group", *args))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "raylm",
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """Receive one bucket the trainer (group rank 0) broadcasts; start its send before calling."""
        args = (names, dtypes, shapes, group_name)
        await self._update(flush_cache, weight_version, "update_weights_from_distributed", *args)

    async def destroy_weights_update_group(self, group_name: str = "raylm") -> None:
        await self.core.exclusive(lambda: self.on_ranks("destroy_weights_update_group", group_name))

    async def _update(self, flush_cache: bool, weight_version: str | None, method: str, *args: Any) -> None:
        await self.core.update_weights(lambda: self.on_ranks(method, *args), flush_cache, weight_version)


# The controls an engine that is not the core's own process (RayEngine) passes on as they are, and those the
# offline LLM offers (vLLM's LLM has no pause: its generate blocks the one thread that could ask).
FORWARDED = tuple(n for n, f in vars(EngineControls).items() if inspect.iscoroutinefunction(f) and n[0] != "_")
OFFLINE = tuple(n for n in FORWARDED if n not in ("pause_generation", "resume_generation", "is_paused"))


def forwarding(call: Callable[[Any, str, tuple, dict], Any], names: tuple[str, ...], *, sync: bool = False):
    """A class decorator giving the class each control of ``names`` the class does not define itself, as a
    method with EngineControls' signature and docstring whose body is ``call(self, name, args, kwargs)``: awaited
    (an async method) or returned (``sync``). Written once here so the signatures stand in one place."""

    def decorate(cls: type) -> type:
        for name in names:
            if name not in vars(cls):
                setattr(cls, name, _forwarder(call, name, sync, cls))
        return cls

    return decorate


def _forwarder(call: Callable, name: str, sync: bool, cls: type) -> Callable:
    if sync:

        def method(self, *args: Any, **kwargs: Any) -> Any:
            return call(self, name, args, kwargs)
    else:

        async def method(self, *args: Any, **kwargs: Any) -> Any:
            return await call(self, name, args, kwargs)

    control = getattr(EngineControls, name)
    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    method.__doc__ = control.__doc__
    method.__signature__ = inspect.signature(control)
    return method


def _copy(function: types.FunctionType) -> types.FunctionType:
    """Another function object running the same code, with the same name, defaults, annotations and docstring, and
    no ``__wrapped__`` pointing back (Ray follows that to the original)."""
    copy = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(copy, function)
    del copy.__wrapped__
    return copy
