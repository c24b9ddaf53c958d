"""The one engine client the Serve app talks through: the async EngineClient protocol, which RayEngine
(ray_client.py) and InProcessEngine (inprocess.py) implement, the factory that gives a replica its engine, and the
engine's helpers serve uses where no engine runs (a prompt's block hashes for the request router)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from engine.adapters import EngineAdapters
from engine.config import EngineConfig
from engine.streams import EngineStopping
from scheduler import EngineRequest, RequestOutput, SchedulerStats
from scheduler.block_hash import extend_block_hashes, first_block_key
from workers.grammars import closed_schema

if TYPE_CHECKING:  # Ray's placement group and the engines import Ray and the model stack when a client starts
    from ray.util.placement_group import PlacementGroup

    from workers.model_spec import ModelSpec

# What serve takes from the engine beside the client: the error a stopping engine ends streams with, the handle
# the LoRA registry reaches an engine's adapters through, and the JSON-schema closing the grammars apply.
__all__ = ["EngineAdapters", "EngineClient", "EngineStopping", "closed_schema", "engine_client", "prompt_block_hashes"]


class EngineClient(Protocol):
    """What a server sees of one engine, as vLLM's EngineClient is its OpenAI server's: async, the caller never
    steps it. ``generate`` checks the request (request_check.check_request: a RequestError, a ValueError naming
    the field, raised by the call, before any stream exists; ``check_request`` alone checks one) and returns its
    deltas as they come; leaving the stream early or cancelling it aborts the request and frees its KV blocks;
    ``abort_request`` does too, and ends the request's open stream with its final deltas (finish_reason "abort").
    ``end_callers`` ends every stream open by raising the error in it. ``check_health`` raises RuntimeError saying
    why the engine cannot serve; it may block (it asks every rank), so a server calls it on a thread. The facts
    (``model_path`` ...) are fixed once the client exists. ``adapters`` is the picklable handle another process
    (the deployment's LoRA registry) reaches this engine's adapters through; None where no other process can
    (the in-process engine).

    The RL controls: ``sleep(level)`` releases the ranks' KV (1) or KV and weights (2), a ValueError naming the
    live requests' count if any (pause first); ``wake_up(tags)`` ("weights", "kv_cache"; None: both).
    ``pause_generation(mode)`` returns once no step is in flight: "abort" ends every live request with
    finish_reason "abort" (their streams hear it) and returns how many; "wait" returns once the live ones
    finished; "keep" freezes them, to go on after ``resume_generation``. A weight update (from tensors, a
    checkpoint directory, or the trainer's broadcast into a group made by ``init_weights_update_group``) runs
    with no step in flight, is atomic (a refusal is a ValueError naming the tensor, the old weights serving on),
    forgets the prefix cache unless ``flush_cache=False``, and names the weights ``weight_version`` when given
    (``get_weight_version``: "default" until then). ``collective_rpc`` and ``get_weights_by_name`` return every
    rank's reply, in rank order.
    """

    config: EngineConfig
    model_path: str
    spec: ModelSpec
    max_model_len: int
    num_blocks: int
    device: str
    adapters: EngineAdapters | None

    def check_request(self, request: EngineRequest) -> EngineRequest: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort_request(self, request_id: str) -> None: ...

    def end_callers(self, error: BaseException) -> int: ...

    async def get_stats(self) -> SchedulerStats: ...

    async def prefix_hit_blocks(self, request: EngineRequest) -> int: ...

    async def routing_digest(self, limit: int) -> tuple[list[bytes], int]: ...

    async def list_loras(self) -> set[str]: ...

    async def load_lora(self, name: str, path: str) -> None: ...

    async def unload_lora(self, name: str) -> None: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...

    # The RL rollout controls (issue #71; vLLM's and SGLang's names): every method of engine/controls.py's
    # EngineControls, with its signature, and these two. While asleep or paused nothing is scheduled and new
    # requests wait, served after wake_up / resume_generation.

    async def collective_rpc(self, method: str, args: tuple = ()) -> list: ...

    async def get_weights_by_name(self, name: str) -> list: ...


def engine_client(config: EngineConfig, placement_group: PlacementGroup, first_bundle: int) -> EngineClient:
    """A Serve replica's engine: the Ray engine, placed in the replica's own placement group from ``first_bundle``
    on (Serve reserved it with placement.engine_bundles)."""
    from engine.ray_client import RayEngine

    return RayEngine(config, placement_group=placement_group, first_bundle=first_bundle)


def prompt_block_hashes(request: EngineRequest, block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the engine's prefix cache keys them (the cache salt and
    the LoRA adapter hashed into block 0)."""
    hashes: list[bytes] = []
    key = first_block_key(request.cache_salt, request.lora_name)
    extend_block_hashes(hashes, request.prompt_token_ids, block_size, key)
    return hashes
