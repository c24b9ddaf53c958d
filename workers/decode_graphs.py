"""CUDA graphs of the decode forward: a decode-only step (or one verifying k proposals a request) padded to one of a
few batch sizes, each captured once."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kernels import AttentionMetadata
from workers.runner_inputs import InputBuffers

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """The forward of steps whose requests all have ``q`` tokens, q in ``query_lens`` (1: decodes; 1 + k: steps
    verifying k proposals a request), captured at each of ``sizes`` (ascending) requests and replayed in place of
    the forward.

    Such a step of n <= max(sizes) requests is padded to the next size (``InputBuffers.pad_decode``: q-token requests
    on the null block, which write slot 0 and read only block 0), so that its forward is one of a few fixed shapes;
    a size whose tokens (size * q) exceed ``max_tokens`` (a step's token limit, the input buffers' size) is not
    captured for that q, and its steps run eagerly (the capture logs which, for each q > 1). A graph
    reads its inputs from the runner's buffers in place (their addresses never change) and the KV cache at the
    address it had when captured, so capture comes after the cache is bound; the attention backend's plan is made
    inside the graph, from those buffers. ``graphs[(size, q)]`` is the captured graph and the hidden states it
    writes.
    """

    def __init__(self, sizes: list[int] | None, query_lens: tuple[int, ...] = (1,), max_tokens: int = 0) -> None:
        self.sizes = sorted(sizes or [])
        self.query_lens = query_lens
        self.max_tokens = max_tokens
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def shapes(self) -> list[tuple[int, int]]:
        """The (size, q) pairs to capture, the most tokens first (the smaller graphs reuse its memory pool)."""
        fits = [(s, q) for q in self.query_lens for s in self.sizes if self._fits(s, q)]
        return sorted(fits, key=lambda shape: (shape[0] * shape[1], shape), reverse=True)

    def _fits(self, size: int, query_len: int) -> bool:
        """Whether `size` requests of `query_len` tokens fit the input buffers (max_tokens; 0: no limit)."""
        return not self.max_tokens or size * query_len <= self.max_tokens

    def max_graph_tokens(self) -> int:
        return max((s * q for s, q in self.shapes()), default=0)

    def padded_size(self, num_reqs: int, num_tokens: int, query_len: int = 1) -> int:
        """The padded size of a step of ``num_reqs`` requests of ``query_len`` tokens each that fits a captured
        shape, else 0."""
        if query_len not in self.query_lens or num_tokens != num_reqs * query_len:
            return 0
        size = next((s for s in self.sizes if s >= num_reqs), 0)
        return size if self._fits(size, query_len) else 0

    def replay(self, size: int, query_len: int = 1) -> torch.Tensor | None:
        """The hidden states of the graph of ``(size, query_len)`` replayed; None when none is captured (an eager
        step)."""
        captured = self.graphs.get((size, query_len))
        if captured is None:
            return None
        graph, hidden = captured
        graph.replay()
        return hidden

    def capture(
        self,
        model: torch.nn.Module,
        buffers: InputBuffers,
        attn_backend: Any,
        max_model_len: int,
        explain: bool = True,
    ) -> None:
        """Capture every shape, the most tokens first so that the smaller graphs reuse its memory pool; then, if
        ``explain``, log the verification batches that ``max_tokens`` leaves eager (``explain_eager``). The
        target's capture explains; the draft's, of the same shapes, would repeat it.

        A backend that cannot be captured (a flash-attn build that syncs with the host in its decode path, say)
        makes the capture raise: every graph is then dropped and decodes (and verifications, naming k) run
        eagerly, with a warning naming the error, rather than failing the engine at start."""
        try:
            pool = None
            for size, query_len in self.shapes():
                pool = self._capture(size, query_len, pool, model, buffers, attn_backend, max_model_len)
            torch.cuda.synchronize()
        except Exception as e:  # whatever broke the capture, eager decodes are the remedy
            verifying = "".join(
                f" and verifying num_speculative_tokens={q - 1} proposals" for q in self.query_lens if q > 1
            )
            warnings.warn(
                f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding{verifying} eagerly, as "
                "enforce_eager=True would",
                stacklevel=2,
            )
            self.graphs.clear()
            self.sizes = []
            return
        if explain:
            self.explain_eager()

    def explain_eager(self) -> None:
        """Log, for each verification length q > 1 (k = q - 1 proposals a request) whose larger sizes exceed
        ``max_tokens``, the largest batch that replays a graph and the smallest that runs eagerly, as every larger
        one does (the sizes fit up to one and none after: they ascend)."""
        for q in self.query_lens:
            fits = [s for s in self.sizes if self._fits(s, q)]
            if q == 1 or len(fits) == len(self.sizes):
                continue
            eager = self.sizes[len(fits)]
            logger.info(
                "raylm: verification steps (num_speculative_tokens=%d) replay CUDA graphs at batches of up to %d "
                "requests and run eagerly above: a batch of %d takes %d tokens, over a step's %d "
                "(max_num_batched_tokens)",
                q - 1,
                fits[-1] if fits else 0,
                eager,
                eager * q,
                self.max_tokens,
            )

    def _capture(
        self,
        size: int,
        query_len: int,
        pool: Any,
        model: torch.nn.Module,
        buffers: InputBuffers,
        attn_backend: Any,
        max_model_len: int,
    ) -> Any:
        dev = buffers.dev
        num_tokens = size * query_len
        buffers.pad_decode(0, size, query_len)
        buffers.upload(num_tokens, size, 0)

        def forward() -> torch.Tensor:
            # The metadata is built in the graph: a backend's plan (flash-attn's key offsets) is then recomputed
            # from the buffers at each replay, not frozen at its capture-time values.
            md = AttentionMetadata.build(
                query_start_loc=dev["query_start_loc"][: size + 1],
                seq_lens=dev["seq_lens"][:size],
                block_tables=dev["block_tables"][:size],
                slot_mapping=dev["slot_mapping"][:num_tokens],
                max_query_len=query_len,
                max_seq_len=max_model_len,
                backend=attn_backend,
            )
            return model(dev["input_ids"][:num_tokens], dev["positions"][:num_tokens], md)

        graph, hidden = capture_graph(forward, pool)
        self.graphs[(size, query_len)] = (graph, hidden)
        return graph.pool()


def capture_graph(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`forward` captured in a CUDA graph drawing on memory pool `pool` (None: a new one), and the tensor it
    returned, which each replay rewrites. Run once before, outside the capture: Triton compiles and cuBLAS picks
    its kernels there, neither of which a capture may do."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        hidden = forward()
    return graph, hidden
