"""The MoE router's top-k on CUDA in one kernel: softmax, top-k and renormalization of each token's logits in one
program, where torch's ops take about five launches per layer (softmax, topk, sum, divide), so a MoE decode step
captured in a CUDA graph replays fewer kernels.

weights, ids = route(router_logits, top_k, renormalize)   # as kernels.moe.route: [T, k] fp32, [T, k] int64

The tests run it on CPU tensors under TRITON_INTERPRET=1 against kernels.moe's torch path (the same ids, weights
within 1e-6); tests/kernels/gpu_compile.py compiles it for sm_90, sm_89 and sm_80. Never run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _route_kernel(
    weights_ptr,
    ids_ptr,
    logits_ptr,
    row_stride,
    col_stride,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program: token t's TOP_K experts from row t of the logits (E of them, any float dtype): the fp32
    softmax over all E, its TOP_K largest in descending order (the lowest expert first among equal ones), divided
    by their sum when RENORMALIZE; written to row t of weights [T, TOP_K] fp32 and ids [T, TOP_K] int64."""
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    logits = tl.load(logits_ptr + t * row_stride + experts * col_stride, valid, float("-inf")).to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, 0))
    # Padding lanes hold 0: they lose every tie to a real expert (a lower index), so never fill a slot.
    probs = exp / tl.sum(exp, 0)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for k in tl.static_range(TOP_K):
        best, expert = tl.max(probs, 0, return_indices=True, return_indices_tie_break_left=True)
        slot = slots == k
        weights = tl.where(slot, best, weights)
        ids = tl.where(slot, expert, ids)
        probs = tl.where(experts == expert, -1.0, probs)  # below every probability: chosen once only
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)  # the slots past TOP_K hold 0
    chosen = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, weights, chosen)
    tl.store(ids_ptr + t * TOP_K + slots, ids, chosen)


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """kernels.moe.route of router_logits [T, E] in one launch: weights [T, top_k] float32, ids [T, top_k] int64.
    ValueError for a top_k the E experts cannot fill."""
    tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} with {num_experts} experts: it must be 1 to {num_experts}")
    weights = router_logits.new_empty(tokens, top_k, dtype=torch.float32)
    ids = router_logits.new_empty(tokens, top_k, dtype=torch.int64)
    if tokens:
        # One warp: a row of a few hundred experts at most reduces within it, in registers.
        _route_kernel[(tokens,)](
            weights,
            ids,
            router_logits,
            *router_logits.stride(),
            E=num_experts,
            TOP_K=top_k,
            RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=1,
        )
    return weights, ids
