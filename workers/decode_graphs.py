"""CUDA graphs of the decode forward: a decode-only step padded to one of a few batch sizes, each captured once."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kernels import AttentionMetadata
from workers.runner_inputs import InputBuffers


class DecodeGraphs:
    """The decode forward captured at each of ``sizes`` (ascending), replayed in place of the forward.

    A decode-only step of n <= max(sizes) requests is padded to the next size (``InputBuffers.pad_decode``: one-token
    requests on the null block, which write slot 0 and read only block 0), so that its forward is one of a few
    fixed shapes. A graph reads its inputs from the runner's buffers in place (their addresses never change) and
    the KV cache at the address it had when captured, so capture comes after the cache is bound. ``graphs[size]``
    is the captured graph and the hidden states it writes.
    """

    def __init__(self, sizes: list[int] | None) -> None:
        self.sizes = sorted(sizes or [])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, num_reqs: int, num_tokens: int) -> int:
        """The padded size of a decode-only step that fits a captured size, else 0."""
        if num_tokens != num_reqs or not self.sizes or num_reqs > self.sizes[-1]:
            return 0
        return next(s for s in self.sizes if s >= num_reqs)

    def replay(self, size: int) -> torch.Tensor | None:
        """The hidden states of the graph of ``size`` replayed; None when none is captured (an eager step)."""
        captured = self.graphs.get(size)
        if captured is None:
            return None
        graph, hidden = captured
        graph.replay()
        return hidden

    def capture(self, model: torch.nn.Module, buffers: InputBuffers, attn_backend: Any, max_model_len: int) -> None:
        """Capture every size, largest first so that the smaller graphs reuse its memory pool.

        A backend that cannot be captured (a flash-attn build that syncs with the host in its decode path, say)
        makes the capture raise: every graph is then dropped and decodes run eagerly, with a warning naming the
        error, rather than failing the engine at start."""
        try:
            pool = None
            for size in reversed(self.sizes):
                pool = self._capture(size, pool, model, buffers, attn_backend, max_model_len)
            torch.cuda.synchronize()
        except Exception as e:  # whatever broke the capture, eager decodes are the remedy
            warnings.warn(
                f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly, as enforce_eager=True would",
                stacklevel=2,
            )
            self.graphs.clear()
            self.sizes = []

    def _capture(
        self, size: int, pool: Any, model: torch.nn.Module, buffers: InputBuffers, attn_backend: Any, max_model_len: int
    ) -> Any:
        dev = buffers.dev
        buffers.pad_decode(0, size)
        buffers.upload(size, size, 0)
        md = AttentionMetadata.build(
            query_start_loc=dev["query_start_loc"][: size + 1],
            seq_lens=dev["seq_lens"][:size],
            block_tables=dev["block_tables"][:size],
            slot_mapping=dev["slot_mapping"][:size],
            max_query_len=1,
            max_seq_len=max_model_len,
            backend=attn_backend,
        )
        args = (dev["input_ids"][:size], dev["positions"][:size], md)
        model(*args)  # outside the capture: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = model(*args)
        self.graphs[size] = (graph, hidden)
        return graph.pool()
