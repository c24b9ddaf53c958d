"""Turns a SchedulerOutput into one forward pass over the flattened batch, and samples."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kernels import AttentionMetadata
from scheduler.outputs import ModelRunnerOutput, SampledLogprobs, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from workers.decode_graphs import DecodeGraphs
from workers.draft import DraftModel
from workers.lora import LoraManager
from workers.parallel import StageLink, pipeline_stage
from workers.runner_inputs import (
    CachedRequestState,
    InputBuffers,
    PendingStep,
    PromptLogprobRows,
    StepInputs,
    logprob_stats,
)
from workers.sampler import PenaltyState, Sampler, SamplingMetadata, has_penalties, skip_draws, verified_logprobs
from workers.structured_output import GrammarBitmasks


class ModelRunner:
    """Keeps the persistent batch and runs the model once per step over prefill chunks and decodes.

    Invariants: ``token_ids[row, :num_tokens]`` and ``block_table[row, :num_blocks]``
    mirror each live request's state; rows of finished requests are free for
    reuse. Every rank appends each step's sampled ids itself (rank 0 samples and
    broadcasts them), and feeds them to the request's matcher, so a rank's copy
    holds every token of the steps it ran and the scheduler can plan the next
    step before it has seen them (async scheduling). Logits are computed only at
    the last scheduled position of requests whose tokens are then all computed — the same rule the scheduler uses to
    expect a sampled token — and, for requests asking ``prompt_logprobs``, at
    each prompt position of their chunks whose logprob was not yet returned.

    A step has no avoidable host work or sync: inputs are built with numpy into
    persistent buffers and copied without blocking, sampling tensors are made
    before the forward is queued, penalty statistics are updated on the device,
    and the sampled ids come back in one transfer, the step's only sync. With
    ``decode_sizes``, a decode-only step is padded to a size whose forward is a
    captured CUDA graph (workers/decode_graphs.py).

    A step is launched (``launch``: queued on the device) and finished
    (``finish``: its ids on the host, appended, its output made) separately, so
    with async scheduling the next step is built and queued while the device
    still runs this one, and the host never makes the device wait: its input
    ids at the positions the unfinished step sampled are copied from that
    step's sampled ids on the device. At most one step is unfinished when
    another is launched, and none when the new one needs the tokens on the
    host (``_overlaps``).

    With a draft model (speculative decoding, the sampling rank only) the draft runs over each step's tokens
    after the target, and proposes for the sampled requests after their tokens are appended (workers/draft.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device,
        is_driver: bool = True,
        max_rows: int = 64,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        decode_sizes: list[int] | None = None,
        graph_query_lens: tuple[int, ...] = (1,),
        grammar: GrammarBitmasks | None = None,
        link: StageLink | None = None,
        lora: LoraManager | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.model = model
        self.draft = draft
        self.lora = lora
        self.grammar = grammar
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.device = device
        self.is_driver = is_driver
        self.stage = pipeline_stage()
        self.link = link
        # One stage, tp > 1: the other ranks need rank 0's samples, as the next step's inputs. Several stages:
        # the ranks that do not sample get the tokens from the scheduler with the request's next step (a
        # request is then never in two steps in flight that sample it), so no rank waits for the last stage.
        self.pipelined = self.stage.count > 1
        self.broadcast = dist.is_initialized() and dist.get_world_size() > 1 and not self.pipelined
        self.sampler = Sampler()
        self.penalty_state = PenaltyState(vocab_size, device)
        self.requests: dict[str, CachedRequestState] = {}
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_rows, self.max_blocks_per_req), dtype=np.int32)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        max_reqs = max(max_num_seqs, *(decode_sizes or []), 1)
        self.decode_graphs = DecodeGraphs(decode_sizes, graph_query_lens, max(max_num_batched_tokens, max_reqs))
        self.buffers = InputBuffers(
            max(max_num_batched_tokens, max_reqs),
            max_reqs,
            self.max_blocks_per_req,
            device,
            token_slots=lora is not None and device.type == "cuda",
        )
        if draft is not None:
            draft.use_buffers(self.buffers, self.decode_graphs)
        if "token_slots" in self.buffers.dev:
            lora.batch.token_slots = self.buffers.dev["token_slots"]
        self.sampled_host = torch.zeros((2, 2 * max_reqs), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.num_copies = 0
        self.unfinished: deque[PendingStep] = deque()  # launched steps not yet finished, oldest first

    # ---- applying the diff ------------------------------------------------------

    def _take_row(self) -> int:
        if not self.free_rows:
            rows = self.token_ids.shape[0]
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self.free_rows.append(state.row)
        for rid in so.preempted_req_ids:
            self.requests[rid].parked = True
        for new in so.scheduled_new_reqs:
            row = self._take_row()
            params = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
                skip_draws(gen, len(new.output_token_ids), self.vocab_size)
            prompt = new.prompt_token_ids
            self.token_ids[row, : len(prompt)] = prompt
            self.block_table[row, : len(new.block_ids)] = new.block_ids
            penalized = self.is_driver and has_penalties(params)
            if penalized:
                self.penalty_state.start(row, prompt, self.token_ids.shape[0])
            state = self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                row,
                len(prompt),
                [],
                len(new.block_ids),
                new.num_computed_tokens,
                params,
                gen,
                penalized,
                matcher=self._matcher(params),
                lora_name=new.lora_name,
            )
            for token in new.output_token_ids:  # sampled by the engine that computed its prompt (a KV transfer)
                self._append([state], [token])
                if penalized:
                    device = self.penalty_state.device
                    self.penalty_state.count(torch.tensor([row], device=device), torch.tensor([token], device=device))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            new_blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                state.parked = False
                state.num_blocks = 0
            if new_blocks:
                self.block_table[state.row, state.num_blocks : state.num_blocks + len(new_blocks)] = new_blocks
                state.num_blocks += len(new_blocks)
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.new_token_ids and not self.is_driver:  # pipelined: the samples this rank did not make
                for token in cached.new_token_ids[i]:
                    self.token_ids[state.row, state.num_tokens] = token
                    state.output_token_ids.append(token)

    def _matcher(self, params: SamplingParams) -> Any:
        if params.structured_outputs is None or not self.is_driver:
            return None
        if self.grammar is None:
            raise ValueError("this runner has no tokenizer for structured outputs")
        return self.grammar.matcher(params.structured_outputs)

    # ---- one step ---------------------------------------------------------------------

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled tokens of all requests into one batch (numpy, no per-token Python),
        written into the persistent buffers and queued for the device."""
        states = [self.requests[rid] for rid in so.num_scheduled_tokens]
        if self.lora is not None:
            states, req_slots = self.lora.group(states)
        num_reqs = len(states)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        num_new = np.fromiter((so.num_scheduled_tokens[s.req_id] for s in states), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        spec = so.scheduled_spec_decode_tokens
        if spec:  # before the input ids are gathered from the rows
            self._write_drafts(states, spec)
        # Each request's tokens in the batch: its scheduled ones, and in a verification step whose requests verify
        # different counts, padding after them up to a captured graph's 1 + k.
        counts = num_new
        verify_len = self._verify_padding(states, num_new, starts, spec) if spec else 0
        if verify_len:
            counts = np.full(num_reqs, verify_len, dtype=np.int64)
        buf = self.buffers.writable()
        cu = buf["query_start_loc"]
        cu[0] = 0
        np.cumsum(counts, out=cu[1 : num_reqs + 1])
        total = int(cu[num_reqs])
        token_req = np.repeat(np.arange(num_reqs), counts)
        positions = buf["positions"][:total]
        np.subtract(np.arange(total), np.repeat(cu[:num_reqs] - starts, counts), out=positions)
        buf["input_ids"][:total] = self.token_ids[rows[token_req], positions]
        host_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=num_reqs)
        pending_rows = np.fromiter((s.pending[1] if s.pending else -1 for s in states), dtype=np.int64, count=num_reqs)
        # Positions holding a token the unfinished step sampled: their ids are written on the device below. (A
        # proposal's position is past the host's tokens too, but its request has no unfinished step: _overlaps.)
        late = np.flatnonzero((positions == host_tokens[token_req]) & (pending_rows[token_req] >= 0))
        num_late = len(late)
        buf["late_positions"][:num_late] = late
        buf["late_rows"][:num_late] = pending_rows[token_req[late]]
        seq_lens = starts + counts
        buf["seq_lens"][:num_reqs] = seq_lens
        block_tables = buf["block_tables"]
        np.take(self.block_table, rows, axis=0, out=block_tables[:num_reqs])
        bs = self.block_size
        buf["slot_mapping"][:total] = block_tables[token_req, positions // bs].astype(np.int64) * bs + positions % bs
        if verify_len:  # the padding's keys and values go to the null slot; the tokens before them never read them
            buf["slot_mapping"][:total][positions >= (starts + num_new)[token_req]] = 0
        num_tokens = host_tokens + (pending_rows >= 0)
        if spec:
            num_tokens += np.fromiter((len(spec.get(s.req_id, ())) for s in states), dtype=np.int64, count=num_reqs)
        sampling = np.nonzero(starts + num_new == num_tokens)[0]
        prompt_spans, pool_spans = [], []
        for i, s in enumerate(states):
            first, count = s.prompt_logprob_span(int(starts[i]), int(num_new[i]))
            if count:
                prompt_spans.append((s, first, count, int(cu[i]) + first - int(starts[i])))
            if s.sampling_params.pooling is not None:
                done = bool(seq_lens[i] == num_tokens[i])
                pool_spans.append((s, int(cu[i]), int(num_new[i]), int(starts[i]), done))
        if pool_spans:  # an embedding request samples nothing: no logits
            sampling = sampling[[states[i].sampling_params.pooling is None for i in sampling]]
        ends = (cu[:num_reqs] + num_new)[sampling]
        num_drafts = draft_ids = None
        if spec:
            num_drafts, draft_ids, index = self._draft_rows([states[i] for i in sampling], spec, ends)
            num_logits = len(index)
            buf["logits_indices"][:num_logits] = index
        else:
            num_logits = len(sampling)
            buf["logits_indices"][:num_logits] = ends - 1
        if self.lora is not None:  # request i's num_new[i] tokens use slot req_slots[i]
            token_slots = np.repeat(req_slots, counts)
            if "token_slots" in buf:
                buf["token_slots"][:total] = token_slots
            else:
                self.lora.batch.set(token_slots)
        # Every request with the same count (decodes; or proposals verified, k each): a captured graph's shape.
        query_len = int(counts[0]) if num_reqs and (counts == counts[0]).all() else 0
        graph_size = self.decode_graphs.padded_size(num_reqs, total, query_len)
        if graph_size:
            self.buffers.pad_decode(num_reqs, graph_size, query_len)
            num_reqs, total = graph_size, graph_size * query_len
        dev = self.buffers.upload(total, num_reqs, num_logits, num_late)
        if num_late:
            sampled = self.unfinished[-1].sampled
            dev["input_ids"].index_copy_(0, dev["late_positions"], sampled.index_select(0, dev["late_rows"]))
        md = AttentionMetadata.build(
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_tables=dev["block_tables"],
            slot_mapping=dev["slot_mapping"],
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            backend=self.attn_backend,
        )
        return StepInputs(
            dev["input_ids"],
            dev["positions"],
            md,
            dev["logits_indices"],
            [states[i] for i in sampling],
            graph_size,
            prompt_spans,
            pool_spans,
            num_drafts,
            draft_ids,
            query_len if graph_size else 1,
        )

    def _verify_padding(
        self, states: list[CachedRequestState], num_new: np.ndarray, starts: np.ndarray, spec: dict[str, list[int]]
    ) -> int:
        """The tokens a request to pad a verification step to (1 + k, a captured graph's), or 0: only a step whose
        requests all decode, verifying between 0 and k proposals but not all k (n-gram proposals, whose counts
        vary, or are all below k for a request alone; a draft model's near a request's max_tokens or
        max_model_len), whose padding stays below max_model_len, and whose batch a graph captures. Padding after a
        request's tokens changes none of its hidden states, the target's or a draft's catching up on the same
        inputs: attention is causal, and the padding's KV goes to the null slot."""
        query_len = max(self.decode_graphs.query_lens)
        if query_len == 1 or (num_new == query_len).all() or (num_new == 1).all() or (num_new > query_len).any():
            return 0
        proposals = np.fromiter((len(spec.get(s.req_id, ())) for s in states), dtype=np.int64, count=len(states))
        decoding = num_new == proposals + 1
        if not decoding.all() or (starts + query_len > self.max_model_len).any():
            return 0
        return query_len if self.decode_graphs.padded_size(len(states), len(states) * query_len, query_len) else 0

    def _write_drafts(self, states: list[CachedRequestState], spec: dict[str, list[int]]) -> None:
        """Each proposal into its request's row after its tokens (the step's input ids there). Accepted ones
        stay, as they become tokens; rejected ones are overwritten by the tokens that follow."""
        for state in states:
            drafts = spec.get(state.req_id)
            if drafts:
                self.token_ids[state.row, state.num_tokens : state.num_tokens + len(drafts)] = drafts

    def _draft_rows(
        self, states: list[CachedRequestState], spec: dict[str, list[int]], ends: np.ndarray
    ) -> tuple[list[int], torch.Tensor, np.ndarray]:
        """The logits rows of a step with proposals: 1 + k per sampling request (its last k + 1 positions), the
        proposal each verifies (-1: none), and their positions in the batch."""
        num_drafts = [len(spec.get(s.req_id, ())) for s in states]
        counts = np.array(num_drafts, dtype=np.int64) + 1
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        index = np.repeat(ends - counts, counts) + np.arange(int(counts.sum())) - starts
        draft_ids = np.full(len(index), -1, dtype=np.int64)
        for s, start, k in zip(states, starts[np.cumsum(counts) - counts], num_drafts):
            draft_ids[start : start + k] = spec[s.req_id] if k else []
        return num_drafts, torch.from_numpy(draft_ids).to(self.device, non_blocking=True), index

    def prepare_sampling(
        self, states: list[CachedRequestState], rows_of: list[CachedRequestState]
    ) -> tuple[SamplingMetadata, torch.Tensor | None, torch.Tensor | None]:
        """The step's sampling metadata over its logits rows (``rows_of[r]``: row r's request; with proposals a
        request has several), and which sampled requests (and runner rows) count for penalties (requests with
        penalties never have proposals)."""
        penalized = [i for i, s in enumerate(states) if s.penalized]
        params = [s.sampling_params for s in rows_of]
        penalties = index = rows = None
        if penalized:
            index = torch.tensor(penalized).to(self.device, non_blocking=True)
            rows = torch.tensor([states[i].row for i in penalized]).to(self.device, non_blocking=True)
            all_rows = torch.tensor([s.row for s in rows_of]).to(self.device, non_blocking=True)
            penalties = self.penalty_state.penalties(params, all_rows)
        states = rows_of
        md = SamplingMetadata.build(
            params,
            [s.generator for s in states],
            [len(s.output_token_ids) + (s.pending is not None) for s in states],
            self.eos_token_id,
            self.vocab_size,
            self.device,
            penalties,
            [s.output_token_ids for s in states],
        )
        return md, index, rows

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Hidden states of the step's tokens (padding rows included), by graph replay when one is captured; None
        on a pipeline stage before the last, which hands its output to the next stage."""
        hidden = self.decode_graphs.replay(inputs.graph_size, inputs.graph_query_len)
        if hidden is not None:
            return hidden
        stage = self.stage
        intermediate = None if stage.is_first else self.link.recv(inputs.input_ids.shape[0])
        out = self.model(inputs.input_ids, inputs.positions, inputs.metadata, intermediate)
        if stage.is_last:
            return out
        self.link.send(*out)
        return None

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.finish(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingStep:
        """Apply step ``so``'s diff and queue its forward, its sampling and the copy of its sampled ids to the host,
        without waiting for the device. Launched while the step before is unfinished (async scheduling), its
        input ids at the positions that step sampled are taken from that step's sampled ids on the device; a step
        that needs them on the host first (``_overlaps``) finishes it before anything else."""
        keep = 1 if self._overlaps(so) else 0
        while len(self.unfinished) > keep:
            self._complete(self.unfinished.popleft())
        self.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            empty = ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if self.is_driver else None
            return PendingStep([], finished=True, output=empty)
        inputs = self.prepare_inputs(so)
        states = inputs.sampling_states
        rows_of = states
        if inputs.num_drafts is not None:
            rows_of = [s for s, k in zip(states, inputs.num_drafts) for _ in range(k + 1)]
        sampling = self.prepare_sampling(states, rows_of) if self.is_driver and states else None
        hidden = self.forward(inputs)
        if hidden is None:
            return PendingStep([], finished=True)
        if self.draft is not None:
            self.draft.catch_up(inputs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices]) if states else None
        prompt_logprobs = self._prompt_logprobs(hidden, inputs.prompt_spans) if inputs.prompt_spans else None
        pooled = self._pool(hidden, inputs.pool_spans) if inputs.pool_spans and self.is_driver else None
        if not states:
            if not self.is_driver:
                return PendingStep([], finished=True)
            # Nothing sampled, so nothing to wait for but these: read at once (a step of prompt chunks only).
            read = prompt_logprobs.to_dict() if prompt_logprobs is not None else None
            out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=read, pooled=pooled)
            return PendingStep([], finished=True, output=out)
        sampled = logprobs = None
        num_drafts = inputs.num_drafts
        if self.is_driver:
            smd, penalized, penalized_rows = sampling
            constrained = [i for i, s in enumerate(rows_of) if s.matcher is not None]
            if constrained:  # filled on the host while the device runs the forward
                matchers = [rows_of[i].matcher for i in constrained]
                smd.grammar = self.grammar.fill(matchers, constrained, len(rows_of))
            if num_drafts is None:
                sampled, logprobs = self.sampler(logits.float(), smd)
            else:  # [S, 2]: (token, accepted proposals), flattened for the one broadcast and transfer
                sampled, logprobs = self.sampler.verify(logits.float(), smd, inputs.draft_ids, num_drafts)
                sampled = sampled.flatten()
            if penalized is not None:
                tokens = sampled if num_drafts is None else sampled[0::2]
                self.penalty_state.count(penalized_rows, tokens.index_select(0, penalized))
        if self.pipelined and not self.is_driver:
            return PendingStep([], finished=True)
        width = 1 if num_drafts is None else 2
        pending = PendingStep(
            states,
            self._share(sampled, width * len(states)),
            num_drafts,
            logprobs,
            prompt_logprobs,
            pooled,
        )
        self._start_copy(pending)
        if num_drafts is None:
            for i, state in enumerate(states):
                state.pending = (pending, i)
        self.unfinished.append(pending)
        return pending

    def _overlaps(self, so: SchedulerOutput) -> bool:
        """Whether step ``so`` may be launched before the unfinished step's sampled ids reach the host: not with a
        draft model or proposals (a step's tokens per request are known only once its acceptances are), on a
        pipeline stage (the scheduler sends those ranks the tokens), nor when a request that step sampled needs
        its tokens on the host to be sampled again (a grammar's matcher, bad words)."""
        if self.draft is not None or self.pipelined or so.scheduled_spec_decode_tokens:
            return False
        return not any(
            p.num_drafts is not None
            or any(s.matcher is not None or s.sampling_params.bad_words_token_ids for s in p.states)
            for p in self.unfinished
        )

    def finish(self, pending: PendingStep) -> ModelRunnerOutput | None:
        """``pending``'s output (None on a rank that does not sample), once its sampled ids are on the host; the
        steps launched before it are finished first, as their tokens come first in the requests' rows."""
        while not pending.finished:
            self._complete(self.unfinished.popleft())
        return pending.output

    def _complete(self, pending: PendingStep) -> None:
        states = pending.states
        token_ids = self._to_host(pending)
        for state in states:
            if state.pending is not None and state.pending[0] is pending:  # no later step holds its next token
                state.pending = None
        num_accepted = None
        if pending.num_drafts is not None:
            token_ids, num_accepted = token_ids[0::2], token_ids[1::2]
        self._append(states, token_ids, num_accepted)
        pending.finished = True
        if not self.is_driver:
            return
        logprobs, accepted_logprobs = self._read_logprobs(pending, num_accepted)
        drafts = self.draft.propose(states, self.token_ids, self.block_table) if self.draft is not None else None
        pending.output = ModelRunnerOutput(
            req_ids=[s.req_id for s in states],
            sampled_token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=pending.prompt_logprobs.to_dict() if pending.prompt_logprobs is not None else None,
            num_accepted_tokens=num_accepted,
            accepted_logprobs=accepted_logprobs,
            pooled=pending.pooled,
            draft_token_ids=drafts,
        )

    @staticmethod
    def _read_logprobs(
        pending: PendingStep, num_accepted: list[int] | None
    ) -> tuple[list[SampledLogprobs | None] | None, list[list[SampledLogprobs]] | None]:
        """The step's logprob entries, read back after its sampled ids: one per sampled token, and, when it
        verified proposals, each request's accepted proposals' (known from ``num_accepted``, on the host now)."""
        if pending.logprobs is None:
            return None, None
        entries = pending.logprobs.to_list()
        if num_accepted is None:
            return entries, None
        return verified_logprobs(entries, pending.num_drafts, num_accepted)

    def _share(self, sampled: torch.Tensor | None, num_sampled: int) -> torch.Tensor:
        """Rank 0's sampled ids (``sampled``, None on the other ranks), on every rank: one broadcast of an int64
        tensor whose length every rank knows (the step's sampling rows, by the rule all ranks share)."""
        if not self.broadcast:
            return sampled
        if sampled is None:
            sampled = torch.empty(num_sampled, dtype=torch.int64, device=self.device)
        dist.broadcast(sampled, src=0)
        return sampled

    def _append(
        self, states: list[CachedRequestState], token_ids: list[int], num_accepted: list[int] | None = None
    ) -> None:
        """Each sampling request's new token (after its accepted proposals, already in its row), into its row and
        outputs, and into its matcher (a stopped matcher takes nothing more: a token sampled after it stopped is
        past the request's end; a constrained request never has proposals)."""
        rows = self.token_ids
        for i, (state, token) in enumerate(zip(states, token_ids)):
            if self.requests.get(state.req_id) is not state:
                continue  # finished while its step was unfinished: its row may be another request's by now
            if num_accepted is not None and num_accepted[i]:
                start = state.num_tokens
                state.output_token_ids.extend(rows[state.row, start : start + num_accepted[i]].tolist())
            rows[state.row, state.num_tokens] = token
            state.output_token_ids.append(token)
            if state.matcher is not None and not state.matcher.is_stopped():
                state.matcher.consume_tokens([token])

    def _prompt_logprobs(
        self, hidden: torch.Tensor, spans: list[tuple[CachedRequestState, int, int, int]]
    ) -> PromptLogprobRows | None:
        """Logprobs of the prompt tokens this step's chunks predict, with each one's rank and top-k, left on the
        device (rank 0 only; every rank joins the vocabulary-parallel logits)."""
        index = np.concatenate([np.arange(b, b + n) for _, _, n, b in spans])
        logits = self.model.compute_logits(hidden[torch.from_numpy(index).to(self.device)])
        for state, first, count, _ in spans:
            state.num_prompt_logprobs = first + count
        if logits is None:
            return None
        targets = np.concatenate([self.token_ids[s.row, first + 1 : first + 1 + n] for s, first, n, _ in spans])
        k = max(s.sampling_params.prompt_logprobs for s, *_ in spans)
        stats = logprob_stats(logits, torch.from_numpy(targets).to(self.device), k)
        return PromptLogprobRows(*stats, [(s.req_id, n, s.sampling_params.prompt_logprobs) for s, _, n, _ in spans])

    def _pool(
        self, hidden: torch.Tensor, spans: list[tuple[CachedRequestState, int, int, int, bool]]
    ) -> dict[str, list[float]]:
        """The embeddings of the requests whose prompt this step completed (rank 0 of the last stage, which holds
        the final hidden states): the last token's or the mean over the prompt, in fp32, shortened to the
        request's ``dimensions`` and L2-normalised. Mean pooling adds each chunk's sum to the request's state as
        its chunks are computed."""
        pooled = {}
        for state, start, count, first, complete in spans:
            params = state.sampling_params
            if params.pooling == "mean":
                chunk = hidden[start : start + count].float().sum(0)
                state.pooled_sum = chunk if first == 0 else state.pooled_sum + chunk
                vector = state.pooled_sum / state.num_prompt_tokens
            else:
                vector = hidden[start + count - 1].float()
            if complete:
                pooled[state.req_id] = torch.nn.functional.normalize(vector[: params.dimensions], dim=-1).tolist()
        return pooled

    def _start_copy(self, pending: PendingStep) -> None:
        """Queue the step's one device-to-host transfer, into pinned memory (one of two halves: at most two steps
        are unfinished, the one launched and the one before it), and record when it is done."""
        if self.device.type != "cuda":
            return
        half = self.sampled_host[self.num_copies % 2]
        self.num_copies += 1
        pending.host = half[: pending.sampled.shape[0]]
        pending.host.copy_(pending.sampled, non_blocking=True)
        pending.copied = torch.cuda.Event()
        pending.copied.record()

    def _to_host(self, pending: PendingStep) -> list[int]:
        """The step's sampled ids as a list: its one sync."""
        if pending.copied is None:
            return pending.sampled.tolist()
        pending.copied.synchronize()
        return pending.host.tolist()

    # ---- start-up -----------------------------------------------------------------------

    @torch.inference_mode()
    def profile_sampling(self, hidden: torch.Tensor, num_rows: int) -> None:
        """Logits and every sampler stage at `num_rows` rows, from rows of `hidden`, with prompt logprobs of
        every row of `hidden` computed meanwhile, as a step does: the memory a full batch of requests using
        penalties, top-k, top-p, min-p, seeds and logprobs takes at once, beside a chunk asking prompt_logprobs."""
        logits = self.model.compute_logits(hidden[torch.arange(num_rows, device=hidden.device) % hidden.shape[0]])
        prompt_logits = self.model.compute_logits(hidden)  # every rank joins the vocabulary-parallel logits
        if not self.is_driver:
            return
        logprob_stats(prompt_logits, torch.zeros(hidden.shape[0], dtype=torch.int64, device=hidden.device), 20)
        del prompt_logits
        params = [
            SamplingParams(
                temperature=0.7,
                top_k=50,
                top_p=0.9,
                min_p=0.05,
                repetition_penalty=1.1,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                seed=0,
                logprobs=20,
            )
        ] * num_rows
        rows = max(num_rows, self.token_ids.shape[0])
        for row in range(num_rows):
            self.penalty_state.start(row, [0], rows)
        gen = torch.Generator(device=self.device)
        penalties = self.penalty_state.penalties(params, torch.arange(num_rows, device=self.device))
        smd = SamplingMetadata.build(
            params, [gen] * num_rows, [0] * num_rows, self.eos_token_id, self.vocab_size, self.device, penalties
        )
        self.sampler(logits.float(), smd)

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture the decode forward at each padded size; needs the KV cache bound (the graphs hold its address)."""
        self.decode_graphs.capture(self.model, self.buffers, self.attn_backend, self.max_model_len)
        if self.draft is not None:
            self.draft.graphs.sizes = self.decode_graphs.sizes  # none where the target's capture failed
            self.draft.capture_graphs(self.max_model_len)
