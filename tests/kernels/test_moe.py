"""The MoE ops against a token-by-token float64 reference: routing edge cases, the shares ranks hold (units of
every expert, or whole experts) summing to the whole, and FP8 experts (the torch path's numerics, which
test_triton_moe.py holds the Triton kernel to)."""

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8 import quantize_experts, quantize_per_token
from kernels.moe import fused_moe, looped_moe, route

E, H, UNITS = 8, 32, 24  # experts, hidden size, units per expert
# FP8 experts' layouts. Tiles of w13 [48, 32] and w2 [32, 24]: one per matrix, w2's ragged in rows and columns
# (48x32); several down the rows (16x32: 3 of w13's, 2 of w2's). Tiles are 32 columns or more: a GPU's 8-bit dot
# takes K >= 32.
FP8_LAYOUTS = {"rows": None, "48x32 blocks": (48, 32), "16x32 blocks": (16, 32)}


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * UNITS, H, generator=g) * 0.3, torch.randn(E, H, UNITS, generator=g) * 0.3


def reference(x, w13, w2, topk_weights, topk_ids, activations=lambda v: v) -> torch.Tensor:
    """`activations`: what each product's input [K] becomes first (FP8 experts quantize it)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w13[e] @ activations(x[t])).chunk(2)
            out[t] += w * (w2[e] @ activations(F.silu(gate) * up))
    return out.float()


def fp8_experts(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts w [E, N, K] quantized per expert and row, or per `block` tile of each: (float8_e4m3fn values,
    float32 scales [E, N] or [E, ceil(N / rows), ceil(K / cols)], the float64 weights they stand for)."""
    stored, scales = quantize_experts(w, block)
    if block is None:
        return stored, scales, stored.double() * scales.double()[:, :, None]
    n, k = w.shape[1:]
    per_element = scales.double().repeat_interleave(block[0], 1)[:, :n].repeat_interleave(block[1], 2)[:, :, :k]
    return stored, scales, stored.double() * per_element


def quantized(x: torch.Tensor, cols: int | None) -> torch.Tensor:
    """x [..., K] quantized per token (per group of `cols` columns), as the float64 values it then stands for."""
    x_fp8, scale = quantize_per_token(x.reshape(-1, x.shape[-1]).float(), cols)
    k = x.shape[-1]
    return (x_fp8.double() * scale.double().repeat_interleave(cols or k, 1)[:, :k]).view(x.shape)


def routing(case: str, tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if case == "all tokens to one expert":
        ids = torch.full((tokens, top_k), 5)
        ids[:, 1:] = torch.arange(1, top_k)  # expert 5 chosen by every token, the other choices fixed too
    elif case == "experts 2, 6 get no token":
        ids = torch.stack(
            [torch.tensor([0, 1, 3, 4, 5, 7])[torch.randperm(6, generator=g)[:top_k]] for _ in range(tokens)]
        )
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g), ids


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("case", ["random", "all tokens to one expert", "experts 2, 6 get no token"])
def test_fused_and_looped_match_the_reference(case, tokens):
    w13, w2 = weights()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing(case, tokens, top_k=2)
    expected = reference(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, topk_weights, topk_ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(looped_moe(x, w13, w2, topk_weights, topk_ids), expected, rtol=1e-5, atol=1e-5)


def test_shares_of_ranks_sum_to_the_whole():
    w13, w2 = weights()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    topk_weights, topk_ids = routing("random", 9, top_k=3)
    whole = fused_moe(x, w13, w2, topk_weights, topk_ids)
    # Expert parallel over two ranks: experts 0-3 and 4-7, whole; pairs routed elsewhere are skipped.
    halves = [
        fused_moe(x, w13[r * 4 : r * 4 + 4], w2[r * 4 : r * 4 + 4], topk_weights, topk_ids, r * 4) for r in (0, 1)
    ]
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=1e-5)
    # A rank whose experts got no token contributes zeros.
    ids_low = topk_ids % 4
    torch.testing.assert_close(
        fused_moe(x, w13[4:], w2[4:], topk_weights, ids_low, 4), torch.zeros_like(x), rtol=0, atol=0
    )
    # Tensor parallel inside every expert: units 0-11 and 12-23 of each, gate and up rows sliced alike.
    gate, up = w13.chunk(2, dim=1)
    slices = [
        fused_moe(x, torch.cat([gate[:, s], up[:, s]], dim=1), w2[:, :, s], topk_weights, topk_ids)
        for s in (slice(0, 12), slice(12, 24))
    ]
    torch.testing.assert_close(slices[0] + slices[1], whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", FP8_LAYOUTS.values(), ids=FP8_LAYOUTS)
def test_fp8_experts_sum_the_values_their_operands_stand_for(block):
    """The torch path of FP8 experts: the weights' FP8 values times their scales, and each product's input
    quantized per token (per group of a tile's columns) as it comes."""
    (w13, w13_scale, w13_values), (w2, w2_scale, w2_values) = (fp8_experts(w, block) for w in weights())
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing("experts 2, 6 get no token", 9, top_k=2)
    cols = None if block is None else block[1]
    expected = reference(x, w13_values, w2_values, topk_weights, topk_ids, lambda v: quantized(v, cols))
    got = fused_moe(x, w13, w2, topk_weights, topk_ids, None, w13_scale, w2_scale, block)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def static_rounding(scale: float):
    """An input [K] rounded through FP8 at one fixed scale, as a static checkpoint's activations are, in float64."""
    return lambda v: (v.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale


STATIC = {"plain experts": False, "FP8 experts": True}


@pytest.mark.parametrize("fp8", STATIC.values(), ids=STATIC)
def test_static_input_scales_quantize_each_products_input_with_its_one_scale(fp8):
    """A static checkpoint's experts: the first product's input (the tokens) rounded through FP8 at w13's scale,
    the second's at w2's, whether the experts are FP8 or held dequantized; a scale small enough that the largest
    inputs saturate at 448 of it."""
    (w13, w13_scale, w13_values), (w2, w2_scale, w2_values) = (fp8_experts(w, None) for w in weights())
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = routing("random", 9, top_k=2)
    s13, s2 = float(x.abs().max()) / 448 * 0.8, 0.002
    rounds = iter([static_rounding(s13), static_rounding(s2)] * 2 * 9)  # each choice's two inputs in turn
    expected = reference(x, w13_values, w2_values, topk_weights, topk_ids, lambda v: next(rounds)(v))
    scales = (w13_scale, w2_scale) if fp8 else (None, None)
    if not fp8:
        w13, w2 = w13_values.float(), w2_values.float()
    got = fused_moe(x, w13, w2, topk_weights, topk_ids, None, *scales, None, torch.tensor(s13), torch.tensor(s2))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    dynamic = fused_moe(x, w13, w2, topk_weights, topk_ids, None, *scales)
    assert (got - dynamic).abs().max() > 1e-3  # the scales are applied, not the per-token (or no) quantization


def test_routing_normalisations():
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(4))
    probs = logits.softmax(-1)
    w, ids = route(logits, 3, renormalize=False)  # Qwen3-MoE without norm_topk_prob
    assert torch.equal(ids, probs.topk(3).indices)
    torch.testing.assert_close(w, probs.gather(1, ids))
    w, ids = route(logits, 3, renormalize=True)  # Mixtral: a softmax over the top-k logits
    torch.testing.assert_close(w, logits.gather(1, ids).softmax(-1))
    assert w.dtype == torch.float32 and route(logits.half(), 3, True)[0].dtype == torch.float32
