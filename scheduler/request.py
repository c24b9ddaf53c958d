"""A request as the scheduler tracks it: its tokens, its status and its blocks' hashes."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler.block_hash import BlockHash, extend_block_hashes, first_block_key
from scheduler.outputs import KVTransfer
from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished; is_finished() relies on the order.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6  # can never fit (prompt too long for the pool or max_model_len)
    FINISHED_ERROR = 7  # the engine failed while running it

    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "error",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, kw_only=True)
class EngineRequest:
    """A request as the engine takes it, built once by its caller and passed whole from the engine client through
    the scheduler actor to ``Scheduler.add_request``, which makes its ``Request``s of it.

    Invariants: the engine's check (engine/request_check.check_request) returns a checked copy before it is
    scheduled, never editing the caller's; ``arrival_time`` is stamped by the engine on its own clock when the
    request reaches it (monotonic clocks differ between processes, so a caller in another one leaves it unset). A field added here
    reaches the scheduler without any signature between changing.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    cache_salt: str | None = None  # keeps its prompt's cached blocks apart from other salts' (tenants)
    lora_name: str | None = None  # the loaded LoRA adapter it runs with; None: the base model
    arrival_time: float | None = None
    # Prefill/decode disaggregation. A prefill engine's request exports its prompt's KV from this block on (the
    # decode engine holds the blocks before it): its first token's delta carries the KVTransfer.
    kv_export_from_block: int | None = None
    # A decode engine's request: its prompt's KV computed elsewhere (staged on the ranks before it is queued) and
    # the token(s) sampled after it, which become its first outputs and are not streamed again.
    kv_transfer: KVTransfer | None = None


class Request:
    """One sequence: its tokens, how far the KV cache has computed them, and its block hashes.

    Invariants the scheduler relies on:
    - ``num_tokens == len(prompt_token_ids) + len(output_token_ids)`` and
      ``0 <= num_computed_tokens <= num_tokens + num_output_placeholders +
      len(spec_token_ids)``: the tokens of steps in flight are computed
      (scheduled) before the scheduler knows their ids; the workers know them
      (they append their own samples). Proposed tokens count as computed until
      the step returns, which rolls the count back over the rejected ones.
    - ``block_hashes[i]`` is the chained hash of full block i of ``all_token_ids``;
      it is extended incrementally by ``append_output_token`` so that hashing costs
      O(block_size) per filled block, never O(context).

    A request with ``n > 1`` is a parent only: the scheduler fans it out into
    children (``index`` 0..n-1, ``parent_id`` set) that each produce one sample,
    each built from a copy of the EngineRequest with its own id and params.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "eos_token_id",
        "priority",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_hashes",
        "block_size",
        "cache_salt",
        "lora_name",
        "parent_id",
        "index",
        "error",
        "num_preemptions",
        "max_total_tokens",
        "num_output_placeholders",
        "queued_s",
        "prompt_logprobs",
        "spec_token_ids",
        "draft_token_ids",
        "kv_export_from_block",
        "kv_transfer",
    )

    def __init__(
        self,
        request: EngineRequest,
        *,
        eos_token_id: int | None = None,
        block_size: int = 16,
        parent_id: str | None = None,
        index: int = 0,
    ) -> None:
        check_engine_request(request)
        request_id, prompt_token_ids, priority = request.request_id, request.prompt_token_ids, request.priority
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = request.sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if request.arrival_time is None else request.arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling
        self.queued_s: float | None = None  # arrival to first scheduling (vllm:request_queue_time_seconds)
        self.block_size = block_size
        self.cache_salt = request.cache_salt
        self.lora_name = request.lora_name
        self.block_hashes: list[BlockHash] = []
        self.parent_id = parent_id
        self.index = index
        self.error: str | None = None
        self.num_preemptions = 0
        self.max_total_tokens = len(prompt_token_ids) + self.sampling_params.max_tokens
        # Tokens sampled by steps scheduled but whose output is not yet applied (async scheduling): the
        # workers already hold them, so the request's next position to compute is one past its known tokens.
        self.num_output_placeholders = 0
        self.prompt_logprobs: list = []  # SampledLogprobs of prompt tokens 1.., until the first output carries them
        # Proposed tokens the step in flight verifies (speculative decoding): computed, not yet known to be tokens.
        self.spec_token_ids: list[int] = []
        # What a draft model proposed after the request's latest token (speculative_method "draft_model"), for its
        # next step: replaced by each step that samples it.
        self.draft_token_ids: list[int] = []
        self.kv_export_from_block = request.kv_export_from_block
        # Until admitted: then its blocks are imported (or, evicted meanwhile, computed here) and it is dropped.
        self.kv_transfer = request.kv_transfer
        if request.kv_transfer is not None:
            self.output_token_ids = list(request.kv_transfer.token_ids)
            self.all_token_ids += self.output_token_ids
        self.extend_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token(self, token_id: int) -> None:
        """A sampled token (the scheduler's per-token hot path: one call, no property, hashing once a block fills)."""
        self.output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        if len(all_token_ids) % self.block_size == 0:
            self.extend_block_hashes()

    def extend_block_hashes(self) -> None:
        extend_block_hashes(
            self.block_hashes, self.all_token_ids, self.block_size, first_block_key(self.cache_salt, self.lora_name)
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def check_engine_request(request: EngineRequest) -> None:
    """A ValueError naming the field when the request's id, prompt, priority or cache salt is malformed."""
    request_id, prompt_token_ids, priority = request.request_id, request.prompt_token_ids, request.priority
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r} is invalid: must be a non-empty string")
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids is a {type(prompt_token_ids).__name__}: must be a list of token ids")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids=[] is invalid: the prompt must have at least one token")
    for t in prompt_token_ids:
        # Block hashing packs ids as int64, so larger ones are as invalid as negative ones.
        if type(t) is not int or not 0 <= t < 2**63:
            raise ValueError(f"prompt_token_ids contains {t!r}: token ids must be integers in [0, 2**63)")
    if not isinstance(priority, int):
        raise ValueError(f"priority={priority!r} is invalid: must be an integer")
    if request.cache_salt is not None and not isinstance(request.cache_salt, str):
        raise ValueError(f"cache_salt={request.cache_salt!r} is invalid: must be a string or None")
