"""What crosses the scheduler/worker boundary each step, and what goes back to callers.

Only diffs travel: a request's prompt and sampling params are sent once, in
``NewRequestData``; afterwards ``CachedRequestData`` carries the new block ids
and how many tokens were computed before this step. Workers keep the rest,
including the tokens they sample: each rank appends a step's samples itself
(vLLM v1's rule), so no sampled token travels back from the scheduler, and a
step can be scheduled before the previous one's samples reach the scheduler.

Every type here is built by keyword (``kw_only``): they are wide, and a record built by position takes a field
added or moved later silently into the wrong slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from scheduler.sampling_params import SamplingParams


@dataclass(slots=True, kw_only=True)
class KVPart:
    """One prefill rank's share of a request's KV: KV heads ``head_start .. head_start + num_heads - 1`` of every
    layer, keys and values, for the transfer's blocks. ``data`` is the transport's handle to the rank's array
    (``[2, num_layers, num_blocks, block_size, num_heads, head_dim]``, the cache's dtype as raw bytes): a Ray
    ObjectRef between processes, the array itself within one. The scheduler never opens it."""

    head_start: int
    num_heads: int
    data: Any


@dataclass(slots=True, kw_only=True)
class KVTransfer:
    """A prompt's KV computed by another engine (prefill/decode disaggregation): blocks ``first_block`` up to the
    one holding the last prompt token, one ``KVPart`` per rank of the engine that computed them, and the
    ``token_ids`` that engine sampled after the prompt (the decode engine's first outputs).

    Invariant: the parts together hold every KV head of the model, and a block's content is the same whichever
    engine computed it (same model, block size and KV dtype: the PD app checks it at start)."""

    first_block: int
    num_prompt_tokens: int
    block_size: int
    parts: list[KVPart]
    token_ids: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_prompt_tokens // self.block_size) - self.first_block


class KVTransferError(RuntimeError):
    """A request's transferred KV could not reach this engine's ranks (the engine that computed it is gone, or its
    objects are lost): nothing of the request was queued or kept, so its caller may compute the prompt again."""


@dataclass(slots=True, kw_only=True)
class KVImport:
    """Blocks a rank fills this step, before the forward, from the KV it staged for ``req_id``: ``block_ids[i]``
    takes block ``first_block + i`` of the prompt, which is index ``first_block - staged_first_block + i`` of the
    staged array (a decode engine's prefix cache may already hold some of the transfer's leading blocks)."""

    block_ids: list[int]
    offset: int


@dataclass(slots=True, kw_only=True)
class NewRequestData:
    """A request the workers have not seen: everything they need to hold it. ``output_token_ids`` are tokens it
    has sampled elsewhere (a KV transfer's first token), after ``prompt_token_ids``."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: tokens whose KV is already in block_ids
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class CachedRequestData:
    """Requests the workers already hold, as parallel lists (no per-request objects on the hot path).

    For entry i: when ``resumed_from_preemption[i]`` is true the request was preempted
    and its KV freed: ``new_block_ids[i]`` is its whole new block table, and
    ``num_computed_tokens[i]`` restarts from the prefix-cache hit. Otherwise
    ``new_block_ids[i]`` is appended to the block table the workers hold.
    ``new_token_ids[i]`` (pipeline parallelism only; empty otherwise) are the
    request's tokens sampled since it was last scheduled, for the ranks that do
    not sample: without pipelining every rank appends the samples itself.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True, kw_only=True)
class SchedulerOutput:
    """One step's plan, broadcast identically to every tensor-parallel rank.

    ``num_scheduled_tokens[req_id]`` tokens are computed for each scheduled
    request, starting at its ``num_computed_tokens``. A request samples a token
    this step iff its computed count reaches its full token count (the
    worker's own copy of prompt + outputs, which holds every token sampled by
    the steps before this one: ranks run steps in order and append their own
    samples). With async scheduling the scheduler plans step N+1 before it has
    seen step N's samples, counting them as placeholders
    (``Request.num_output_placeholders``); the plan is the same as if it had.
    ``finished_req_ids`` (finished or aborted since the last step) and
    ``preempted_req_ids`` tell workers whose state to drop or park.

    A request with proposals (``scheduled_spec_decode_tokens``) is scheduled for
    its last token and its k proposed ones, and samples iff its computed count
    then reaches its token count plus k.

    ``blocks_to_swap_out`` are (device block, host block) pairs and
    ``blocks_to_swap_in`` (host block, device block) pairs. Every rank applies
    all swap-outs, then all swap-ins, then the forward: a swap-out reads a
    device block this step's swap-ins or forward may write, and a swap-in
    writes a block this step's forward reads (KVCacheManager says why the
    scheduler's plan is safe in that order).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    step_id: int = 0
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: a request's proposed tokens, scheduled after its last token (1 + k tokens this step);
    # the ranks verify them and sample the token that follows the accepted ones.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Prefill/decode disaggregation. ``kv_exports``: after the forward, each rank reads these blocks (a prompt's,
    # from the request's kv_export_from_block on) and hands them to the transport. ``kv_imports``: before the
    # forward (after the swaps), each rank writes the KV it staged for the request into these blocks.
    kv_exports: dict[str, list[int]] = field(default_factory=dict)
    kv_imports: dict[str, KVImport] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True, kw_only=True)
class SampledLogprobs:
    """Logprobs of one sampled (or prompt) token: its own, and the top-k alternatives (most likely first).
    ``rank`` (1 = most likely) is filled for prompt tokens, which vLLM's format reports."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None


@dataclass(slots=True, kw_only=True)
class ModelRunnerOutput:
    """What rank 0 returns for one step: one sampled token per request that sampled.

    ``logprobs[i]`` is None for requests that did not ask for logprobs; the
    whole list is None when nobody did. ``prompt_logprobs`` maps a request
    asking for them to the entries of the prompt tokens its chunk predicted
    this step (token p given tokens < p, in order, each returned once). ``pooled`` maps each embedding request
    (``SamplingParams.pooling``) whose prompt this step completed to its embedding; it samples nothing.

    Speculative decoding: ``num_accepted_tokens[i]`` (None when no request had
    proposals) is how many of request i's proposed tokens were accepted; its new
    tokens are those proposals followed by ``sampled_token_ids[i]``, and
    ``accepted_logprobs[i]`` (with ``logprobs``) are the accepted ones' entries.
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[SampledLogprobs | None] | None = None
    prompt_logprobs: dict[str, list[SampledLogprobs]] | None = None
    num_accepted_tokens: list[int] | None = None
    accepted_logprobs: list[list[SampledLogprobs]] | None = None
    pooled: dict[str, list[float]] | None = None
    # A draft model's proposals (speculative_method "draft_model") after the newest token of each speculable
    # request that sampled (every one, [] where the draft had no room), for its next step; None without a draft.
    draft_token_ids: dict[str, list[int]] | None = None
    # The step's KV exports (SchedulerOutput.kv_exports), one part per rank, set by the transport from every rank's
    # reply: the requests' final outputs carry them to the caller as a KVTransfer.
    kv_exports: dict[str, list[KVPart]] | None = None


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """One delta streamed back to a caller: the tokens a request gained this step.

    ``request_id`` is the caller's id; ``index`` tells the samples of an
    ``n > 1`` request apart. ``finish_reason`` is "stop", "length", "abort" or
    "error" on the last delta (with ``error`` explaining an "error").
    ``prompt_logprobs`` (requests asking for them) rides on the first delta that
    has a token: one entry per prompt token after the first (empty for a
    one-token prompt). ``embedding`` is an embedding request's result, on its one (final) delta. ``kv_transfer``
    (a request with ``kv_export_from_block``) is its prompt's KV for a decode engine, on its final delta.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[SampledLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    queued_s: float | None = None  # on the final delta: arrival to first scheduling, None if it never ran
    prompt_logprobs: list[SampledLogprobs] | None = None
    embedding: list[float] | None = None
    kv_transfer: KVTransfer | None = None


# A delta that carries tokens and nothing else (nearly every one) crosses processes as (request_id, index,
# new_token_ids): Ray's pickler makes a Python call for each object it meets, and a slotted dataclass pickles as
# a dict of its twelve fields, which made the outputs' trip from the scheduler actor to a Serve replica the
# largest CPU cost of both (docs/serving.md). The names and defaults are read from the class, so a field added
# later travels in the full form whenever it is set.
_NAMES = tuple(f.name for f in fields(RequestOutput))
_DEFAULTS = {f.name: f.default for f in fields(RequestOutput)}
_PLAIN = ("request_id", "index", "new_token_ids")
_TAIL = tuple(name for name in _NAMES if name not in _PLAIN)
_ALL_FIELDS = attrgetter(*_NAMES)
_TAIL_FIELDS = attrgetter(*_TAIL)
_TAIL_DEFAULTS = tuple(_DEFAULTS[name] for name in _TAIL)


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """The deltas as tuples for a trip between processes; unpack_outputs gives them back equal."""
    return [
        (o.request_id, o.index, o.new_token_ids) if _TAIL_FIELDS(o) == _TAIL_DEFAULTS else _ALL_FIELDS(o)
        for o in outputs
    ]


def unpack_outputs(packed: list[tuple]) -> list[RequestOutput]:
    return [
        RequestOutput(request_id=t[0], index=t[1], new_token_ids=t[2])
        if len(t) == len(_PLAIN)
        else RequestOutput(**dict(zip(_NAMES, t)))
        for t in packed
    ]


def merge_deltas(deltas: list[RequestOutput]) -> list[RequestOutput]:
    """Fold the queued deltas of each sample into one, so a consumer that lags costs one object per sample."""
    if len(deltas) == 1:
        return deltas
    by_index: dict[int, list[RequestOutput]] = {}
    for d in deltas:
        by_index.setdefault(d.index, []).append(d)
    return [group[0] if len(group) == 1 else _fold(group) for group in by_index.values()]


def _fold(group: list[RequestOutput]) -> RequestOutput:
    """A sample's consecutive deltas as one: the tokens and their logprobs concatenated, every other field the
    value of the latest delta that set it (prompt logprobs ride on an early delta, the final fields on the
    last), so a field added later is kept with no rule here."""
    merged = {
        name: next((v for d in reversed(group) if (v := getattr(d, name)) != default), default)
        for name, default in _DEFAULTS.items()
    }
    merged["new_token_ids"] = [t for d in group for t in d.new_token_ids]
    if any(d.new_logprobs for d in group):
        merged["new_logprobs"] = [lp for d in group for lp in d.new_logprobs or []]
    return RequestOutput(**merged)
