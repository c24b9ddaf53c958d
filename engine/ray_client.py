"""The Ray executor: a placement group, one worker actor per tensor-parallel rank, and the scheduler actor
that steps them. RayEngine is its client in the caller's process: the synchronous interface.Engine (what
the offline LLM drives), and client.EngineClient (what the Serve app talks through: async streams of deltas,
streams.py, and health)."""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.adapters import EngineAdapters
from engine.config import EngineConfig, derive_scheduler_config, derive_worker_config
from engine.connect import connect
from engine.controls import FORWARDED, forwarding
from engine.health import diagnose
from engine.interface import check_draft_model, resolve_max_model_len
from engine.placement import SCHEDULER_CPUS, bundle_device, engine_bundles, place, resolve_device
from engine.request_check import check_request
from engine.scheduler_actor import SchedulerActor
from engine.startup import init_workers, start_workers
from engine.streams import DeltaStreams
from scheduler import EngineRequest, RequestOutput, SchedulerStats, unpack_outputs

if TYPE_CHECKING:  # torch and the model stack: seconds of import that `raylm serve`'s own process never needs
    from workers.model_spec import ModelSpec

RaySchedulerActor = ray.remote(SchedulerActor)

T = TypeVar("T")


def _release(pg: PlacementGroup | None, actors: list) -> None:
    """Kill the engine's actors and free its own placement group (run once, through weakref.finalize). The
    scheduler actor (last in ``actors``) goes first: a step it has in flight would otherwise fail on the killed
    workers and log an engine failure at every shutdown."""
    if not ray.is_initialized():
        return
    for actor in reversed(actors):
        ray.kill(actor)
    if pg is not None:
        remove_placement_group(pg)


@forwarding(lambda engine, name, args, kwargs: getattr(engine.actor, name).remote(*args, **kwargs), FORWARDED)
class RayEngine:
    """One engine on a Ray cluster: a placement group, the scheduler actor, one worker actor per rank.

    Invariants: once __init__ returns, every rank holds its model shard and a KV
    cache of the same ``num_blocks`` and the scheduler loop runs; if __init__
    fails it leaves no actor or placement group behind, and shutdown() (or
    garbage collection) releases them. Given a ``placement_group`` (a Serve
    replica's, which Serve reserved with engine_bundles at ``first_bundle``), the
    engine places itself there and leaves the group to its owner; otherwise it
    reserves its own, called ``placement_group_name``. The synchronous
    interface (interface.Engine) and the async streams take their deltas from two
    channels of the scheduler actor, so either may be used alone or both at once.
    ``_unfinished`` maps each id added through add_request to its samples still
    running, so step() knows without a round trip whether there is anything to wait for.
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str | None = None,
        *,
        placement_group: PlacementGroup | None = None,
        first_bundle: int = 0,
        placement_group_name: str = "",
    ) -> None:
        self.config = config
        self.model_path = config.resolved_model()
        # Reading the checkpoints imports transformers: seconds of CPU. Where Ray is already joined (a Serve
        # replica) the ranks' processes start meanwhile; otherwise a bad model is refused before Ray starts.
        joined = ray.is_initialized()
        if not joined:
            draft_spec = self._read_checkpoints()
        connect(address, SCHEDULER_CPUS + config.world_size * (config.num_threads or 1), config.placement_timeout_s)
        self.device = (
            bundle_device(placement_group, first_bundle + 1)
            if placement_group is not None and config.device == "auto"
            else resolve_device(config.device)
        )
        pg = placement_group or place(
            engine_bundles(config, self.device == "cuda"),
            config.placement_strategy,
            config.placement_timeout_s,
            config.tensor_parallel_size,
            name=placement_group_name,
        )
        self.placement_group = pg
        owned: list = []
        self._finalizer = weakref.finalize(self, _release, None if placement_group else pg, owned)
        self._unfinished: dict[str, int] = {}
        self._received = 0  # the last batch number the synchronous channel got (get_outputs)
        self._sync_loop: asyncio.AbstractEventLoop | None = None  # where ``sync`` runs the async controls
        try:
            self.workers = start_workers(config, pg, first_bundle, self.device)
            owned.extend(self.workers)
            if joined:
                draft_spec = self._read_checkpoints()
            worker_config = derive_worker_config(
                config, self.model_path, self.max_model_len, model_spec=self.spec, draft_spec=draft_spec
            )
            self.actor = RaySchedulerActor.options(
                num_cpus=SCHEDULER_CPUS,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle),
            ).remote(self.workers, self.spec.eos_token_id)
            owned.append(self.actor)
            self.adapters = EngineAdapters(self.actor)
            self.streams = DeltaStreams(self.actor, f"async-{os.getpid()}-{id(self)}")
            self.num_blocks, num_host_blocks, self.rank_nodes = init_workers(
                self.workers,
                worker_config,
                config.num_threads,
                self.device,
                config.placement_timeout_s,
                config.cpu_omp_threads_bind,
            )
            swap_cost = ray.get(self.workers[0].call.remote("swap_cost_per_block"))
            ray.get(
                self.actor.start.remote(
                    derive_scheduler_config(
                        config,
                        self.num_blocks,
                        self.max_model_len,
                        num_host_blocks,
                        swap_cost,
                        on_gpu=self.device == "cuda",
                    ),
                    config.step_timeout_s,
                    tuple(config.lora_paths),
                    config.kv_events,
                )
            )
        except BaseException:
            self.shutdown()
            raise

    def _read_checkpoints(self) -> ModelSpec | None:
        """Set ``spec`` and ``max_model_len`` from the model's checkpoint and return the draft model's spec (None
        without one); ValueError for a model, split or length the engine cannot run."""
        from workers.model_loader import read_model_spec
        from workers.parallel import partition_layers

        config = self.config
        self.spec = read_model_spec(
            self.model_path, config.tensor_parallel_size, config.enable_expert_parallel, config.quantization
        )
        partition_layers(self.spec.num_layers, config.pipeline_parallel_size, config.layer_partition)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        return check_draft_model(config, self.model_path, self.spec, self.max_model_len)

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group; in-flight requests end with an actor error."""
        self._finalizer()
        if self._sync_loop is not None:
            self._sync_loop.close()
            self._sync_loop = None

    # ---- synchronous interface (interface.Engine) ------------------------------------------

    def add_request(self, request: EngineRequest) -> list[RequestOutput]:
        request = self.check_request(request)
        finals = ray.get(self.actor.add_request.remote(request, "sync"))
        if len(finals) < request.sampling_params.n:
            self._unfinished[request.request_id] = request.sampling_params.n - len(finals)
        return finals

    def step(self) -> list[RequestOutput]:
        """The deltas of add_request's requests that arrived since the last call (waits for at least one)."""
        if not self._unfinished:
            return []
        self._received, packed = ray.get(self.actor.get_outputs.remote("sync", self._received))
        outputs = unpack_outputs(packed)
        for out in outputs:
            if out.finished and out.request_id in self._unfinished:
                self._unfinished[out.request_id] -= 1
                if not self._unfinished[out.request_id]:
                    del self._unfinished[out.request_id]
        return outputs

    def abort(self, request_id: str) -> list[RequestOutput]:
        self._unfinished.pop(request_id, None)
        return ray.get(self.actor.abort.remote(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def stats(self) -> SchedulerStats:
        return ray.get(self.actor.stats.remote())

    def lora_names(self) -> set[str]:
        return set(ray.get(self.adapters.lora_names()))

    def add_lora(self, name: str, path: str) -> None:
        ray.get(self.adapters.add_lora(name, path))

    def remove_lora(self, name: str) -> None:
        ray.get(self.adapters.remove_lora(name))

    # ---- client.EngineClient: async streams, health, routing ----------------------------------

    def check_request(self, request: EngineRequest) -> EngineRequest:
        """The request as this engine takes it, or a RequestError naming the field (request_check.check_request)."""
        return check_request(request, self.spec, self.max_model_len)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's deltas as they come; leaving the loop early (or being cancelled) aborts it. The request
        is checked here, before the stream exists: a RequestError is raised by this call."""
        return self.streams.stream(self.check_request(request))

    async def abort_request(self, request_id: str) -> None:
        """Abort the request (its KV blocks are freed); its open stream ends with the abort's final deltas."""
        for out in await self.actor.abort.remote(request_id):
            if (queue := self.streams.queues.get(out.request_id)) is not None:
                queue.put_nowait(out)

    def end_callers(self, error: BaseException) -> int:
        """End every ``generate`` still running by raising ``error`` in it (DeltaStreams.end_callers)."""
        return self.streams.end_callers(error)

    async def get_stats(self) -> SchedulerStats:
        return await self.actor.stats.remote()

    def check_health(self) -> None:
        """Raise RuntimeError saying why when the engine cannot serve, naming the ranks lost and their nodes.
        Blocks while it asks every rank: the Serve app calls it on a thread."""
        diagnose(self.actor, self.workers, self.rank_nodes, self.config.tensor_parallel_size)

    async def prefix_hit_blocks(self, request: EngineRequest) -> int:
        """How many of the request's leading prompt blocks this engine's prefix cache holds now: the blocks a
        prefill engine need not send it (``EngineRequest.kv_export_from_block``)."""
        return await self.actor.prefix_hit_blocks.remote(request)

    async def routing_digest(self, limit: int) -> tuple[list[bytes], int]:
        return await self.actor.routing_digest.remote(limit)

    async def list_loras(self) -> set[str]:
        return set(await self.adapters.lora_names())

    async def load_lora(self, name: str, path: str) -> None:
        await self.adapters.add_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        await self.adapters.remove_lora(name)

    # ---- client.EngineClient: the RL controls (engine/controls.py runs them in the scheduler actor; the class
    # decorator forwards those not written here) ----

    def sync(self, call: Awaitable[T]) -> T:
        """Run one of the async controls to completion from synchronous code (the offline LLM's face), on an
        event loop of this engine's own."""
        if self._sync_loop is None:
            self._sync_loop = asyncio.new_event_loop()
        return self._sync_loop.run_until_complete(call)

    async def update_weights_from_tensor(
        self, named_tensors: Any, flush_cache: bool = True, weight_version: str | None = None
    ) -> None:
        """``named_tensors``: a list of (name, tensor), or a Ray ObjectRef of one. A list is put in the object store
        once here; every rank fetches the one object."""
        ref = named_tensors if isinstance(named_tensors, ray.ObjectRef) else ray.put(named_tensors)
        await self.actor.update_weights_from_tensor.remote([ref], flush_cache, weight_version)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Every rank's reply to Worker method ``method``, asked of the ranks directly (their replies may hold
        tensors, which the torch-free scheduler actor cannot unpickle), beside the steps."""
        return list(await asyncio.gather(*[w.call.remote(method, *args) for w in self.workers]))

    async def get_weights_by_name(self, name: str) -> list:
        """Every rank's CPU copy of its shard of parameter ``name`` (model.named_parameters' name)."""
        return await self.collective_rpc("get_weights_by_name", (name,))
