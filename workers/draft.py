"""A draft model for speculative decoding: a smaller model with the target's vocabulary proposing k tokens per
request and step, greedily, on the sampling rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kernels import AttentionBackend, AttentionMetadata
from workers.cache_engine import CacheEngine
from workers.decode_graphs import DecodeGraphs
from workers.layers import can_pack, pack_for_cpu
from workers.model_loader import load_model, read_model_spec
from workers.model_spec import ModelSpec
from workers.runner_inputs import CachedRequestState, InputBuffers, StepInputs

# The proposal passes' inputs, staged at once: per pass and row ("T": k passes x R rows), or per row.
_PER_PASS = ("positions", "slot_mapping", "seq_lens")
_STAGING = {
    "positions": (torch.int64, "T"),
    "slot_mapping": (torch.int64, "T"),
    "seq_lens": (torch.int32, "T"),
    "block_tables": (torch.int32, "RxB"),
    "query_start_loc": (torch.int32, "R+1"),
    "input_ids": (torch.int64, "R"),
}


def check_draft(target: ModelSpec, target_dir: str, draft_dir: str, max_model_len: int) -> ModelSpec:
    """The draft's spec, or a ValueError naming the setting when it cannot propose for the target: another
    vocabulary (size, special tokens or the tokenizer's vocabulary), more parameters than the target (it would
    cost more than it saves), or fewer positions than max_model_len."""
    draft = read_model_spec(draft_dir)
    where = f"speculative_config model={draft_dir!r}"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where} has vocab_size={draft.vocab_size}, the target {target.vocab_size}: a draft must share the "
            "target's tokenizer"
        )
    if (draft.eos_token_id, draft.bos_token_id) != (target.eos_token_id, target.bos_token_id) or _vocab(
        draft_dir
    ) != _vocab(target_dir):
        raise ValueError(f"{where} has another tokenizer than the target: a draft must share the target's tokenizer")
    if draft.num_parameters() > target.num_parameters():
        raise ValueError(
            f"{where} has {draft.num_parameters():,} parameters, more than the target's {target.num_parameters():,}: "
            "a draft must be smaller than the model it proposes for"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"{where} has max_position_embeddings={draft.max_position_embeddings}, under max_model_len="
            f"{max_model_len}: the draft must reach every position the target serves"
        )
    return draft


def _vocab(model_dir: str) -> dict | None:
    """The tokenizer's token -> id map from tokenizer.json, or None where the directory has none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("model", {}).get("vocab")


class DraftModel:
    """The draft, unsharded, on the sampling rank only: the other ranks need no proposals (the scheduler sends
    them to every rank with the next step), and unsharded it runs no collective, so no rank waits on it. Its
    weights and KV cost that one rank's memory (``block_bytes`` adds to the rank's per-block bytes, so the pool's
    block count counts both caches).

    Invariants:
    - its KV cache has the target's blocks (same count and size; its own tensor, shaped by its layers and heads)
      and is addressed by the target's block tables and slots, so the scheduler's one allocation covers both,
      the prefix cache and the host tier included (``swap`` moves the same blocks);
    - ``catch_up`` runs it over each step's scheduled tokens (the target's input ids, positions and slots), so
      its KV follows the target's: prefill chunks, accepted proposals, and rejected ones rewritten next step;
    - ``propose`` runs k greedy single-token passes per speculable sampled request, from its newest token, each
      writing the KV of its input position: only positions below max_model_len in blocks the request holds (the
      scheduler allocates k lookahead slots for them). Those are past the computed tokens: the next steps
      rewrite them before anything reads them as context;
    - it runs on the target runner's input buffers (``use_buffers``): the catch-up reads the target's step
      inputs in place, and the passes write theirs after the target's step has read them, so on CUDA both replay
      graphs of the target's shapes, in a private pool of the draft's own;
    - the passes' inputs are staged in buffers of its own (``staging``: pinned on CUDA, copied without blocking, and
      rewritten only once the last copies have read them, as the target's inputs are).
    Greedy proposals are a one-hot draft distribution, for which the sampler's rejection rule (accept with
    probability p(t)) is exact. The GPU memory profile counts the draft: its weights are loaded before it, and
    its forward over the profile's step (``Worker.profile_draft``, on a throwaway cache) measures the draft's
    peak and, scaled, its graph pool, which the verification shapes (up to max_num_seqs * (1 + k) tokens) make
    tens of MB for a 0.5B draft and as large as the target's when the target is its own draft.
    """

    def __init__(
        self,
        model_dir: str,
        spec: ModelSpec,
        num_speculative_tokens: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.spec = spec  # check_draft's, read by the engine
        self.model = load_model(model_dir, dtype=dtype, device=device, attn_backend=backend, spec=spec)
        if can_pack(device, dtype):
            pack_for_cpu(self.model)
        self.k = num_speculative_tokens
        self.backend, self.dtype, self.device = backend, dtype, device
        self.block_size, self.max_model_len = block_size, max_model_len
        self.cache: CacheEngine | None = None
        self.buffers: InputBuffers | None = None  # the target runner's (use_buffers)
        self.staging: InputBuffers | None = None  # the proposal passes' inputs, sized by the target's (use_buffers)
        self.graphs = DecodeGraphs(None)

    def block_bytes(self) -> int:
        spec = self.spec
        return CacheEngine.block_bytes(spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim, self.dtype)

    def init_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        spec = self.spec
        self.cache = CacheEngine(
            spec.num_layers,
            num_blocks,
            self.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            self.dtype,
            self.device,
            num_host_blocks,
        )
        self.cache.bind(self.model.attention_layers)

    def drop_cache(self) -> None:
        """Let the cache go (the memory profile's throwaway one), unbound from the layers."""
        CacheEngine.unbind(self.model.attention_layers)
        self.cache = None

    def use_buffers(self, buffers: InputBuffers, graphs: DecodeGraphs) -> None:
        """Run on the target runner's input buffers, with graphs of the target's shapes (``graphs``' sizes and
        query lengths), once captured: the catch-up reads the target's step inputs in place, and the proposal
        passes write their own into the same buffers once the target's step no longer needs them."""
        self.buffers = buffers
        self.graphs = DecodeGraphs(graphs.sizes, graphs.query_lens, graphs.max_tokens)
        max_reqs, max_blocks = buffers.host["block_tables"].shape
        self.staging = InputBuffers(self.k * max_reqs, max_reqs, max_blocks, self.device, layout=_STAGING)

    def capture_graphs(self, max_model_len: int) -> None:
        """The draft's forward captured at the target's shapes (needs its cache bound), in a pool of its own: a
        draft graph replays while the target's hidden states, in the target's pool, are still to be read. Silent
        about verification batches left eager: the target's capture, of the same shapes, said which."""
        self.graphs.capture(self.model, self.buffers, self.backend, max_model_len, explain=False)

    def catch_up(self, inputs: StepInputs) -> None:
        """The step's tokens through the draft, for their KV (the outputs are not needed): the graph of the
        target's step shape when captured, else eagerly."""
        if self.graphs.replay(inputs.graph_size, inputs.graph_query_len) is None:
            self.model(inputs.input_ids, inputs.positions, inputs.metadata, None)

    def propose(
        self, states: list[CachedRequestState], token_ids: np.ndarray, block_table: np.ndarray
    ) -> dict[str, list[int]]:
        """Up to k proposals after each speculable request's newest token (``token_ids[row, num_tokens - 1]``),
        as many as its held slots and max_model_len allow; one host transfer at the end.

        Every pass runs every request, padded to a captured size (one graph replay a pass): a request past its
        last pass computes position 0 on the null slot, and its proposal there is dropped. The passes' inputs are
        uploaded once and copied into the buffers on the device, so no pass waits for the host."""
        states = [s for s in states if s.sampling_params.speculable]
        if not states:
            return {}
        n, bs = len(states), self.block_size
        rows = np.array([s.row for s in states], dtype=np.int64)
        first = np.array([s.num_tokens - 1 for s in states], dtype=np.int64)  # the newest token's position
        room = np.minimum(np.array([s.num_blocks * bs for s in states]), self.max_model_len) - first
        num_passes = np.clip(room, 0, self.k)
        passes = int(num_passes.max())
        if passes == 0:
            return {}
        size = self.graphs.padded_size(n, n) or n
        staged, max_seq_len = self._stage(rows, first, num_passes, passes, size, token_ids, block_table)
        dev = self.buffers.dev
        for name in ("block_tables", "query_start_loc"):
            dev[name][: staged[name].shape[0]].copy_(staged[name], non_blocking=True)
        tokens = staged["input_ids"]
        out = []
        for j in range(passes):
            dev["input_ids"][:size].copy_(tokens, non_blocking=True)
            for name in _PER_PASS:
                dev[name][:size].copy_(staged[name][j], non_blocking=True)
            hidden = self.graphs.replay(size, 1)
            if hidden is None:
                md = AttentionMetadata.build(
                    query_start_loc=dev["query_start_loc"][: size + 1],
                    seq_lens=dev["seq_lens"][:size],
                    block_tables=dev["block_tables"][:size],
                    slot_mapping=dev["slot_mapping"][:size],
                    max_query_len=1,
                    max_seq_len=max_seq_len,
                    backend=self.backend,
                )
                hidden = self.model(dev["input_ids"][:size], dev["positions"][:size], md, None)
            tokens = self.model.compute_logits(hidden[:size]).argmax(-1)
            out.append(tokens)
        proposals = torch.stack(out, 1)[:n].tolist()
        return {s.req_id: proposals[i][: num_passes[i]] for i, s in enumerate(states)}

    def _stage(
        self,
        rows: np.ndarray,
        first: np.ndarray,
        num_passes: np.ndarray,
        passes: int,
        size: int,
        token_ids: np.ndarray,
        block_table: np.ndarray,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Every pass's inputs for ``size`` rows (the requests', then padding on the null block), written into
        ``staging`` and queued for the device: [passes, size] positions, slots and context lengths, and the rows'
        block tables, query offsets and first input ids; and the longest context (an eager pass's max_seq_len)."""
        n, bs, cells = len(rows), self.block_size, passes * size
        j = np.arange(passes)[:, None]
        active = np.zeros((passes, size), dtype=bool)
        active[:, :n] = j < num_passes[None, :]
        buf = self.staging.writable()
        positions, slots, seq_lens = (buf[name][:cells].reshape(passes, size) for name in _PER_PASS)
        positions[:] = 0
        positions[:, :n] = first[None, :] + j
        positions[~active] = 0
        tables = buf["block_tables"][:size]
        tables[n:] = 0
        tables[:n] = block_table[rows]
        slots[:] = tables[np.arange(size)[None, :], positions // bs].astype(np.int64) * bs + positions % bs
        slots[~active] = 0
        seq_lens[:] = np.where(active, positions + 1, 1)
        buf["query_start_loc"][: size + 1] = np.arange(size + 1)
        input_ids = buf["input_ids"][:size]
        input_ids[n:] = 0
        input_ids[:n] = token_ids[rows, first]
        dev = self.staging.upload(cells, size, 0)
        staged = {name: t.view(passes, size) if name in _PER_PASS else t for name, t in dev.items()}
        return staged, int(seq_lens.max())

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        self.cache.swap(swap_out, swap_in)
