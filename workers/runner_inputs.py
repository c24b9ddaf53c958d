"""What the model runner keeps between steps and builds for each: a request's cached state, the persistent input
buffers, one step's inputs, and the decode sizes captured as CUDA graphs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels import AttentionMetadata
from scheduler.outputs import ModelRunnerOutput, SampledLogprobs
from scheduler.sampling_params import SamplingParams
from workers.sampler import LogprobRows

# Decode batch sizes captured as CUDA graphs (vLLM's and nano-vllm's choice): every size up to 4, then
# every multiple of 8 up to 512. A step of n decodes runs the smallest captured size >= n, padded; a larger
# decode batch runs eagerly, where a step's launch overhead is small against its work anyway.
MAX_GRAPH_SIZE = 512
_GRAPH_SIZES = (1, 2, 4, *range(8, MAX_GRAPH_SIZE + 1, 8))


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured sizes for an engine of `max_num_seqs`: up to the first size that holds them all, at most
    MAX_GRAPH_SIZE (batches beyond it run eagerly)."""
    sizes = [s for s in _GRAPH_SIZES if s < max_num_seqs]
    cover = next((s for s in _GRAPH_SIZES if s >= max_num_seqs), None)
    return sizes + [cover] if cover else sizes


@dataclass(slots=True)
class CachedRequestState:
    """What a worker remembers of one request between steps (the scheduler sends only diffs).

    ``row`` indexes the runner's persistent token and block tables, which hold
    this request's tokens and block ids; ``output_token_ids`` are its outputs in
    Python form (for their count; penalties read the runner's PenaltyState),
    appended by the runner itself as it samples them. A preempted request keeps
    its state (``parked``) until it resumes with a new block table; an embedding request's ``pooled_sum`` restarts
    with a chunk that starts at position 0 (a recompute after preemption). ``matcher`` (sampling rank, constrained requests only) has
    consumed exactly ``output_token_ids``.
    """

    req_id: str
    row: int
    num_prompt_tokens: int
    output_token_ids: list[int]
    num_blocks: int
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    penalized: bool
    parked: bool = False
    matcher: Any = None  # llguidance.LLMatcher
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were returned; kept across preemption
    lora_name: str | None = None  # its LoRA adapter; None: the base model
    pooled_sum: torch.Tensor | None = None  # mean pooling: the sum of the hidden states of the chunks computed
    # The runner's unfinished step that sampled it last and its row in that step's sampled ids (None: none): the
    # token after ``num_tokens``, on the device only until that step finishes. A step launched before the one
    # before it finished samples it again, so only the latest one's row is kept.
    pending: tuple[PendingStep, int] | None = None

    def prompt_logprob_span(self, start: int, num_new: int) -> tuple[int, int]:
        """The positions of a chunk [start, start + num_new) whose logits give a prompt token's logprob not yet
        returned: position q predicts prompt token q + 1. A recompute after preemption yields none twice."""
        if self.sampling_params.prompt_logprobs is None:
            return 0, 0
        first = max(start, self.num_prompt_logprobs)
        return first, max(0, min(start + num_new, self.num_prompt_tokens - 1) - first)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


_BUFFERS = {  # name: (dtype, sized by tokens (T), requests (R), R + 1, R x blocks per request, or late tokens (L))
    "input_ids": (torch.int64, "T"),
    "positions": (torch.int64, "T"),
    "slot_mapping": (torch.int64, "T"),
    "query_start_loc": (torch.int32, "R+1"),
    "seq_lens": (torch.int32, "R"),
    "block_tables": (torch.int32, "RxB"),
    "logits_indices": (torch.int64, "T"),  # one per sampling request, or 1 + k with k proposals
    # Async scheduling: the batch positions of input tokens an unfinished step sampled, and their rows in its
    # sampled ids (at most one such token per request)
    "late_positions": (torch.int64, "L"),
    "late_rows": (torch.int64, "L"),
}


class InputBuffers:
    """A step's input tensors, allocated once for the largest step (`max_tokens` tokens, `max_reqs`
    requests of up to `max_blocks` blocks) and rewritten in place every step: the runner's step inputs
    (``_BUFFERS``), or another ``layout`` of names, dtypes and sizes (the draft's passes, workers/draft.py).

    Invariants: a step writes the host side through the numpy views ``writable()`` returns and
    ``upload`` copies each used prefix once to the device side (``dev``) without blocking; on CPU
    the two sides are one tensor and nothing is copied. The device tensors keep their addresses for
    the runner's life, so a captured CUDA graph reads each step's inputs in place. With copies, the
    host side is pinned, so a copy is truly asynchronous and may still be reading it long after
    ``upload`` returned (a step with no sampled token never syncs, and the GPU can run a step or more
    behind the host): ``upload`` records ``uploaded`` after its copies, and ``writable`` waits for it,
    so the host side is never rewritten under a pending copy.
    """

    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        device: torch.device,
        uploaded: Any = None,
        token_slots: bool = False,
        layout: dict[str, tuple[torch.dtype, str]] = _BUFFERS,
    ) -> None:
        shapes = {
            "T": (max_tokens,),
            "R": (max_reqs,),
            "R+1": (max_reqs + 1,),
            "RxB": (max_reqs, max_blocks),
            "L": (max_reqs,),
        }
        # `uploaded` (an event: record, query, synchronize) is given only by tests, to copy between CPU tensors.
        self.copies = device.type == "cuda" or uploaded is not None
        # With `token_slots` (LoRA on CUDA) each token's adapter slot is an input too: a graph reads it in place.
        self.layout = dict(layout, **({"token_slots": (torch.int64, "T")} if token_slots else {}))
        host = {
            name: torch.zeros(shapes[size], dtype=dtype, pin_memory=device.type == "cuda")
            for name, (dtype, size) in self.layout.items()
        }
        self.np = {name: t.numpy() for name, t in host.items()}
        self.host = host
        self.dev = {name: t.to(device, copy=True) for name, t in host.items()} if self.copies else host
        self.uploaded = uploaded if uploaded is not None else (torch.cuda.Event() if self.copies else None)

    def writable(self) -> dict[str, np.ndarray]:
        """The host side's numpy views, once the last upload's copies have read them."""
        # query() first: after a step's read-back the copies are long done, and a needless wait is a host sync.
        if self.uploaded is not None and not self.uploaded.query():
            self.uploaded.synchronize()
        return self.np

    def upload(self, num_tokens: int, num_reqs: int, num_logits: int, num_late: int = 0) -> dict[str, torch.Tensor]:
        """The device tensors' used prefixes, after queueing their copies."""
        counts = {"T": num_tokens, "R": num_reqs, "R+1": num_reqs + 1, "RxB": num_reqs, "L": num_late}
        out = {}
        for name, (_, size) in self.layout.items():
            n = num_logits if name == "logits_indices" else counts[size]
            out[name] = self.dev[name][:n]
            if self.copies and n:
                out[name].copy_(self.host[name][:n], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        return out

    def pad_decode(self, start: int, end: int, query_len: int = 1) -> None:
        """Rows start..end-1 become requests of ``query_len`` tokens (positions 0..query_len-1) on the null block
        (slot 0, context of ``query_len``), after rows of ``query_len`` tokens each: a step whose requests all have
        that many padded to a captured graph's size."""
        buf = self.writable()
        first, last = start * query_len, end * query_len
        for name in ("input_ids", "slot_mapping"):
            buf[name][first:last] = 0
        buf["positions"][first:last] = np.tile(np.arange(query_len), end - start)
        buf["block_tables"][start:end] = 0
        buf["seq_lens"][start:end] = query_len
        buf["query_start_loc"][start + 1 : end + 1] = np.arange(start + 1, end + 1) * query_len
        if "token_slots" in buf:
            buf["token_slots"][first:last] = -1  # the base model: no adapter's product


def logprob_stats(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Each row's logprob of its target, the target's rank (1 = the likeliest), and the row's top k: what
    prompt_logprobs returns. Holds [rows, vocab] in fp32 twice, beside the logits (the profile counts it)."""
    raw = logits.float().log_softmax(-1)
    chosen = raw.gather(1, targets.unsqueeze(1))
    ranks = (raw > chosen).sum(-1) + 1
    top_values, top_ids = raw.topk(k, dim=-1)
    return chosen.squeeze(1), ranks, top_values, top_ids


@dataclass(slots=True)
class PromptLogprobRows:
    """The logprobs of the prompt tokens a step's chunks predict (``logprob_stats``' tensors, a row a position), on
    the device until ``to_dict`` reads them back: at the step's finish, after its sampled ids, so that a step with
    a prompt_logprobs chunk is launched, like any other, before the one before it has finished. ``spans``: each
    request's id, rows and how many of the top it asked for, in row order."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    spans: list[tuple[str, int, int]]

    def to_dict(self) -> dict[str, list[SampledLogprobs]]:
        # One transfer per tensor; per-row Python only touches plain lists.
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        out, first = {}, 0
        for req_id, count, k in self.spans:
            out[req_id] = [
                SampledLogprobs(logprob=chosen[j], top_token_ids=ids[j][:k], top_logprobs=values[j][:k], rank=ranks[j])
                for j in range(first, first + count)
            ]
            first += count
        return out


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs (device tensors, views of InputBuffers) and what sampling needs.
    ``graph_size`` is the padded batch a captured graph of ``graph_query_len`` tokens a request can run, or 0 for an
    eager step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_states: list[CachedRequestState]
    graph_size: int
    prompt_spans: list[tuple[CachedRequestState, int, int, int]]  # (state, first position, count, batch index)
    # embedding requests: (state, batch index of the chunk's first token, tokens, first position, prompt done)
    pool_spans: list[tuple[CachedRequestState, int, int, int, bool]]
    # Speculative decoding (None in a step without proposals): sampling request i has num_drafts[i] proposals
    # and 1 + num_drafts[i] logits rows; draft_ids (device) holds the proposal each row verifies, -1 on the last.
    num_drafts: list[int] | None = None
    draft_ids: torch.Tensor | None = None
    graph_query_len: int = 1


@dataclass(slots=True)
class PendingStep:
    """A launched step: its forward and sampling queued on the device, its sampled ids maybe still on their way
    to the host (``ModelRunner.launch``; ``ModelRunner.finish`` makes its output).

    Invariants: steps finish in the order they were launched, each once (``finished``, then ``output`` is final);
    while it is unfinished and no later step sampled them, each of ``states`` has ``pending`` = (this step, its row
    of ``sampled``); a step verifying proposals sets none, as its tokens per request are known only on the host. On
    CUDA ``host`` is the pinned buffer the ids are copied into and ``copied`` the event recorded after the copy.
    ``logprobs`` is the sampler's LogprobRows either way, read back at finish: one row per sampled id, or, when
    verifying, one per logits row (a request's accepted proposals', then its sampled token's).
    """

    states: list[CachedRequestState]
    sampled: torch.Tensor | None = None  # [S] ids, or [2S] (token, accepted proposals) when verifying
    num_drafts: list[int] | None = None
    logprobs: LogprobRows | None = None
    prompt_logprobs: PromptLogprobRows | None = None
    pooled: dict[str, list[float]] | None = None
    host: torch.Tensor | None = None
    copied: Any = None  # torch.cuda.Event
    finished: bool = False
    output: ModelRunnerOutput | None = None

    def is_ready(self) -> bool:
        """Whether ``finish`` would return without waiting for the device."""
        return self.finished or self.copied is None or self.copied.query()

    async def wait(self) -> None:
        """Until ``is_ready``, leaving the event loop free meanwhile (the next step is launched then): at once
        where it is (always on CPU: no thread hop), else on a thread blocked on ``copied``, whose synchronize
        releases the GIL, so no core spins while the device runs the step."""
        if not self.is_ready():
            await asyncio.to_thread(self._synchronize)

    def _synchronize(self) -> None:
        # A new thread's current device is 0: a CUDA call from it would make a context on GPU 0, another rank's on a
        # node whose ranks see all its GPUs. A CPU tensor's device is -1, which selects nothing.
        with torch.cuda.device(self.sampled.get_device()):
            self.copied.synchronize()
