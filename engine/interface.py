"""The synchronous interface both executors implement (InProcessEngine, RayEngine), and what they derive alike."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, TypeVar

from engine.config import EngineConfig
from scheduler import EngineRequest, RequestOutput, SchedulerStats

if TYPE_CHECKING:  # torch and the model stack: seconds of import that `raylm serve`'s own process never needs
    from workers.model_spec import ModelSpec

T = TypeVar("T")


class Engine(Protocol):
    """What the offline LLM drives, on either executor. The caller steps it: ``add_request`` checks a request
    (request_check.check_request, raising RequestError, a ValueError, naming the field) and returns the
    deltas already final (a request the prefix cache answers at once); ``step`` returns the deltas since the
    last call, with at least one while ``has_unfinished_requests``. Every delta of a request is returned once,
    to whichever call made it. Kept beside client.EngineClient (the async surface the Serve app talks through,
    which both executors implement too) because the offline LLM is synchronous: it runs no event loop, and
    stepping the engine itself lets it batch every prompt it was given into the same steps, in its own thread.
    The RL controls (sleep, weight updates: client.EngineClient's, written once in engine/controls.py) are async
    on both executors; ``sync`` runs one to completion here, which is the offline LLM's synchronous face onto them
    (one method name cannot be both a synchronous and an async call on the same executor).
    """

    model_path: str
    spec: ModelSpec
    max_model_len: int
    num_blocks: int
    device: str

    def add_request(self, request: EngineRequest) -> list[RequestOutput]: ...

    def lora_names(self) -> set[str]: ...

    def add_lora(self, name: str, path: str) -> None: ...

    def remove_lora(self, name: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> SchedulerStats: ...

    def shutdown(self) -> None: ...

    def sync(self, call: Awaitable[T]) -> T: ...


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return min(spec.max_position_embeddings, 8192)
    if config.max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len={config.max_model_len} is over the model's "
            f"max_position_embeddings={spec.max_position_embeddings}"
        )
    return config.max_model_len


def check_draft_model(config: EngineConfig, model_path: str, spec: ModelSpec, max_model_len: int) -> ModelSpec | None:
    """The speculative_config draft model's spec (None without one), refusing, before any rank loads a weight, a draft
    that cannot propose for this model (workers.draft.check_draft says which)."""
    draft_model = config.speculative.get("model")
    if draft_model is None:
        return None
    from workers.draft import check_draft
    from workers.hub import resolve_model

    return check_draft(spec, model_path, resolve_model(draft_model, None, config.download_dir), max_model_len)
