"""Mixture-of-experts ops: top-k routing and the experts' SwiGLU products, on tensors only.

weights, ids = route(router_logits, top_k, renormalize)             # [T, k] fp32, [T, k] int64
out = fused_moe(x, w13, w2, weights, ids, first_expert)              # [T, H]: this rank's experts' share
out = fused_moe(x, w13, w2, weights, ids, first_expert, w13_scale, w2_scale, block)   # FP8 experts
out = fused_moe(..., w13_input_scale=s13, w2_input_scale=s2)   # static activations: one fixed scale a product

`w13` [E_local, 2 * I, H] stacks each expert's gate and up projections, `w2` [E_local, H, I] its down
projection; E_local and I are whatever this rank holds: every expert's slice of units (`first_expert` None),
or whole experts `first_expert` .. `first_expert + E_local - 1` (expert parallel). The op sums what it
holds; the caller sums over ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import fused
from kernels.cpu_ops import silu_and_mul, small_mm_applies
from kernels.fp8 import fp8_values, quantize_per_tensor, quantize_per_token, round_per_tensor

# Rows per expert up to which raylm's CPU op (`grouped_small_mm`) beats torch's grouped_mm, which runs each
# group through BLAS: at 1 to 16 rows it reads the weights 1.0-1.8x as fast; at 64 the two are even.
SMALL_GROUP_ROWS = 64


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k experts of each token and their weights: the softmax over all experts (in fp32) of the chosen
    ones, divided by their sum when `renormalize` (which equals a softmax over the top-k logits). On CUDA (with
    Triton) it is `kernels.triton_route.route`, one kernel where torch's ops take about five."""
    if fused.on_triton(router_logits):
        from kernels import triton_route

        return triton_route.route(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _grouped(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_local: int, first_expert: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs this rank computes, sorted by expert: their token rows, weights and the
    number of pairs per local expert [num_local]. Pairs routed to another rank's experts are left out."""
    top_k = topk_ids.shape[1]
    local = topk_ids.flatten()
    pairs = None
    if first_expert is not None:
        local = local - first_expert
        pairs = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
        local = local[pairs]
    order = local.argsort(stable=True)
    pair_rows = order if pairs is None else pairs[order]
    counts = torch.bincount(local, minlength=num_local)
    return pair_rows // top_k, topk_weights.flatten()[pair_rows], counts


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, small_groups: bool) -> torch.Tensor:
    """x [M, K] grouped by rows times w [G, N, K] per group: raylm's CPU op when every group has at most
    SMALL_GROUP_ROWS rows (`small_groups`) in fp32, torch's grouped_mm elsewhere."""
    if small_groups and small_mm_applies(x, w):
        return torch.ops.raylm.grouped_small_mm(x, w, offs)
    return F.grouped_mm(x, w.transpose(1, 2), offs=offs)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over each token's chosen experts held here of weight * down(silu(gate(x)) * up(x)), [T, H].

    Tokens are gathered into one buffer grouped by expert, and each projection is one grouped matmul over the
    groups: no loop over experts, and an expert without tokens costs nothing. Buffers are sized by this step's
    T * top_k pairs, so a decode step allocates a decode's worth. On CUDA (with Triton) it is
    `kernels.triton_moe.fused_moe`: grouping and tiling on the device, no host read and no shape that depends on
    the routing, so a CUDA graph could capture it. Elsewhere the pairs are grouped by `_grouped`, whose shapes
    depend on the routing (a host read on CUDA without Triton; on CPU it costs no sync).

    FP8 experts: w13 and w2 float8_e4m3fn with float32 `w13_scale`, `w2_scale`, one per expert and output row
    ([E_local, N]) or one per `block` (rows, cols) tile of each expert's matrix ([E_local, ceil(N / rows),
    ceil(K / cols)]); each product's input quantized per token (per group of `cols` columns with tiles). Off
    CUDA the weights are dequantized to fp32 on every call, the numerics of the Triton kernel for its tests:
    serving never makes CPU experts FP8. Static activations (`w13_input_scale`, `w2_input_scale`: a static
    checkpoint's fixed scales, 0-d float32, row-wise weights only): each product's input quantized with its one
    scale instead, and rounded so where the weights are plain (a static checkpoint's experts held dequantized)."""
    if fused.on_triton(x):
        from kernels import triton_moe

        return triton_moe.fused_moe(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            first_expert,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            block=block,
            input_scales=(w13_input_scale, w2_input_scale),
        )
    out = torch.zeros_like(x)
    tokens, weights, counts = _grouped(topk_ids, topk_weights, w13.shape[0], first_expert)
    if tokens.numel() == 0:
        return out
    offs = counts.cumsum(0, dtype=torch.int32)
    # Read on the host only where it decides something: on CUDA (without Triton) it would be one more sync.
    small_groups = not x.is_cuda and int(counts.max()) <= SMALL_GROUP_ROWS
    h = _products(x.index_select(0, tokens), w13, w13_scale, block, offs, small_groups, w13_input_scale)
    y = _products(silu_and_mul(h), w2, w2_scale, block, offs, small_groups, w2_input_scale)
    y *= weights.to(y.dtype).unsqueeze(1)
    return out.index_add_(0, tokens, y)


def _products(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    offs: torch.Tensor,
    small_groups: bool,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """One grouped product in x's dtype: of plain weights as they are (x first rounded through FP8 at a static
    `input_scale`); of FP8 ones (with `w_scale`) as the values both FP8 operands stand for, summed in fp32."""
    if w_scale is None:
        x = x if input_scale is None else round_per_tensor(x, input_scale)
        return _grouped_mm(x, w, offs, small_groups)
    x_values, w_values = _fp8_values(x, w, w_scale, block, input_scale)
    return _grouped_mm(x_values, w_values, offs, small_groups).to(x.dtype)


def _fp8_values(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int] | None,
    input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per token (per group of block[1] columns with tiles; with the fixed `input_scale` where
    static) and w [G, N, K] float8_e4m3fn, both as the fp32 values they stand for."""
    cols = w.shape[2] if block is None else block[1]
    if input_scale is None:
        x_fp8, x_scale = quantize_per_token(x, None if block is None else cols)
    else:
        x_fp8, x_scale = quantize_per_tensor(x, input_scale)
    return fp8_values(x_fp8, x_scale, (1, cols)), fp8_values(w, w_scale, block)


def looped_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int | None = None,
) -> torch.Tensor:
    """The per-expert loop, as Hugging Face's modeling code runs it: for every expert, find its tokens, run
    it, add. The naive baseline `fused_moe` is tested and benchmarked against."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, choice = (topk_ids == (first_expert or 0) + e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, choice, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out
