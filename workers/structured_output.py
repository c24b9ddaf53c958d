"""Structured outputs on the sampling rank: the per-step token bitmasks of constrained requests, from the
grammars workers/grammars.py compiled."""

from __future__ import annotations

import llguidance
import numpy as np
import torch

from scheduler.sampling_params import StructuredOutputsParams


class GrammarBitmasks:
    """Builds matchers and fills one step's allowed-token bitmasks; lives on the sampling rank only.

    Invariants:
    - a request's matcher has consumed exactly the request's output tokens
      (the runner feeds it each sample as it appends it, before the next step's
      mask: with async scheduling the scheduler has not seen the sample yet),
      so preemption keeps it (a resumed request's outputs are
      unchanged; recomputing KV does not touch it), chunked prefill and prefix
      cache hits never reach it (they are prompt work), each ``n > 1`` child
      has its own, and an abort drops it with the runner's request state;
    - a matcher that is stopped (the grammar is complete) or in error allows
      only the EOS ids, so the scheduler finishes the request with ``stop``,
      or with ``length`` when ``max_tokens`` comes first: it never hangs;
    - only rank 0 samples, so only rank 0 holds matchers: tensor parallelism
      adds no bytes to a step. Masks computed on the scheduler would cost
      6 KiB per constrained request per step (384 KiB at 64, past Ray's
      inline limit) sent to every rank.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.tokenizer_path, self.vocab_size, self.eos_token_ids = tokenizer_path, vocab_size, eos_token_ids
        self.tokenizer: llguidance.LLTokenizer | None = None  # built at the first constraint (~0.3 s)
        self.executor = llguidance.LLExecutor()
        self.words = (vocab_size + 31) // 32
        self.device = device
        self.eos_only = np.zeros(self.words, dtype=np.int32)
        for t in eos_token_ids:
            self.eos_only.view(np.uint32)[t >> 5] |= np.uint32(1 << (t & 31))
        self.host = np.zeros((0, self.words), dtype=np.int32)

    def matcher(self, c: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self.tokenizer is None:
            # Imported at the first constraint, as the tokenizer is loaded: both import transformers, which a rank
            # serving no structured output never needs (1.6 CPU-s of its start).
            from llguidance.hf import from_tokenizer
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self.tokenizer = from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        if c.compiled is None:  # every engine's request check compiles it; a rank never does
            raise ValueError("structured_outputs reached the sampling rank uncompiled (not through check_request)")
        return llguidance.LLMatcher(self.tokenizer, c.compiled, log_level=0)

    def fill(self, matchers: list[llguidance.LLMatcher], rows: list[int], num_rows: int) -> torch.Tensor:
        """[num_rows, V] bool on the device, True where a token is banned: row ``rows[i]`` by ``matchers[i]``,
        other rows ban nothing. Unpacked on the host (numpy's unpackbits: a fraction of a millisecond at
        64 rows), so the sampler masks the batch with one in-place op, no gather or scatter of rows
        (those cost 100+ ms per step at 64 rows on CPU)."""
        n = len(matchers)
        if self.host.shape[0] < n:
            self.host = np.zeros((max(n, 2 * self.host.shape[0]), self.words), dtype=np.int32)
        host = self.host[:n]
        live = [(m, i) for i, m in enumerate(matchers) if not (m.is_stopped() or m.is_error())]
        if live:
            self.executor.unsafe_compute_mask_ptr(live, host.ctypes.data, self.words * 4, n)
        for i, m in enumerate(matchers):
            if m.is_stopped() or m.is_error():
                host[i] = self.eos_only
        return torch.from_numpy(unpack_banned(host, rows, num_rows, self.vocab_size)).to(self.device, non_blocking=True)


def unpack_banned(bitmasks: np.ndarray, rows: list[int], num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows, vocab_size] bool, True where row ``rows[i]``'s bitmask ``bitmasks[i]`` (int32 words, bit t of
    word w: token 32 w + t allowed) has a 0; other rows all False. Little-endian words: byte 4w + t // 8."""
    allowed = np.unpackbits(bitmasks.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    banned = np.zeros((num_rows, vocab_size), dtype=bool)
    banned[rows] = allowed == 0
    return banned
