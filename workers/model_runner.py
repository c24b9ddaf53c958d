"""Turns a SchedulerOutput into one forward pass over the flattened batch, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import AttentionMetadata
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.request import SamplingParams
from workers.sampler import Sampler, SamplingMetadata


@dataclass(slots=True)
class CachedRequestState:
    """What a worker remembers of one request between steps (the scheduler sends only diffs).

    ``row`` indexes the runner's persistent token and block tables, which hold
    this request's tokens and block ids; the lists here are the same tokens in
    Python form for the sampler's penalties. A preempted request keeps its
    state (``parked``) until it resumes with a new block table.
    """

    req_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_blocks: int
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    parked: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class ModelRunner:
    """Keeps the persistent batch and runs the model once per step over prefill chunks and decodes.

    Invariants: ``token_ids[row, :num_tokens]`` and ``block_table[row, :num_blocks]``
    mirror each live request's state; rows of finished requests are free for
    reuse. Logits are computed only at the last scheduled position of requests
    whose tokens are then all computed — the same rule the scheduler uses to
    expect a sampled token.
    """

    def __init__(self, model: torch.nn.Module, attn_backend, block_size: int, max_model_len: int,
                 vocab_size: int, eos_token_id: int | None, device: torch.device, is_driver: bool = True,
                 max_rows: int = 64) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.device = device
        self.is_driver = is_driver
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_rows, self.max_blocks_per_req), dtype=np.int32)
        self.free_rows = list(range(max_rows - 1, -1, -1))

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
            prompt = list(new.prompt_token_ids)
            self.token_ids[row, :len(prompt)] = prompt
            self.block_table[row, :len(new.block_ids)] = new.block_ids
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, row, prompt, [], len(new.block_ids), new.num_computed_tokens, params, gen)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            new_tokens = cached.new_token_ids[i]
            if new_tokens:
                n = state.num_tokens
                self.token_ids[state.row, n:n + len(new_tokens)] = new_tokens
                state.output_token_ids.extend(new_tokens)
            new_blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                state.parked = False
                state.num_blocks = 0
            if new_blocks:
                self.block_table[state.row, state.num_blocks:state.num_blocks + len(new_blocks)] = new_blocks
                state.num_blocks += len(new_blocks)
            state.num_computed_tokens = cached.num_computed_tokens[i]

    # ---- one step ---------------------------------------------------------------------

    def prepare_inputs(self, so: SchedulerOutput):
        """Flatten the scheduled tokens of all requests into one batch (numpy, no per-token Python)."""
        states = [self.requests[rid] for rid in so.num_scheduled_tokens]
        num_reqs = len(states)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        num_new = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        token_req = np.repeat(np.arange(num_reqs), num_new)
        positions = np.arange(total) - np.repeat(cu[:-1] - starts, num_new)
        input_ids = self.token_ids[rows[token_req], positions]
        seq_lens = starts + num_new
        max_seq_len = int(seq_lens.max())
        block_tables = self.block_table[rows, :-(-max_seq_len // self.block_size)]
        bs = self.block_size
        slot_mapping = block_tables[token_req, positions // bs].astype(np.int64) * bs + positions % bs
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=num_reqs)
        sampling = np.nonzero(seq_lens == num_tokens)[0]
        dev = self.device
        md = AttentionMetadata.build(
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            max_query_len=int(num_new.max()), max_seq_len=max_seq_len, backend=self.attn_backend)
        logits_indices = torch.from_numpy(cu[1:][sampling] - 1).to(dev)
        return (torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), md,
                logits_indices, [states[i] for i in sampling])

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], []) if self.is_driver else None
        input_ids, positions, md, logits_indices, sampling_states = self.prepare_inputs(so)
        hidden = self.model(input_ids, positions, md)
        logits = self.model.compute_logits(hidden[logits_indices]) if len(sampling_states) else None
        if not self.is_driver:
            return None
        if logits is None:
            return ModelRunnerOutput([], [])
        smd = SamplingMetadata.build(
            [s.sampling_params for s in sampling_states], [s.generator for s in sampling_states],
            [s.prompt_token_ids for s in sampling_states], [s.output_token_ids for s in sampling_states],
            self.eos_token_id, self.vocab_size, self.device)
        sampled, logprobs = self.sampler(logits.float(), smd)
        return ModelRunnerOutput([s.req_id for s in sampling_states], sampled.tolist(), logprobs)
