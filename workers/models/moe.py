"""The mixture-of-experts feed-forward of Qwen3-MoE and Mixtral, split over the tensor-parallel group."""

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.formats import FP8_MAX
from kernels.fp8 import quantize_experts
from kernels.moe import fused_moe, route
from workers.layers import TensorSlice, check_shape, checkpoint_row_scales, static_input_scale
from workers.model_spec import ModelSpec
from workers.parallel import tp_group


class SparseMoeBlock(nn.Module):
    """Router (replicated) and experts, over `tp_size` ranks in one of two ways. Tensor parallel (default):
    every rank holds units [rank * I/tp, (rank + 1) * I/tp) of every expert. Expert parallel: rank r holds
    experts [r * E/tp, (r + 1) * E/tp) whole. Either way every rank routes every token (its activations are
    replicated after attention's all-reduce), computes the share its weights allow, and one all-reduce of
    [T, hidden] sums the shares: the same collective as a dense MLP's down projection.

    `w13` [E_local, 2 * I_local, hidden] holds each local expert's gate rows then up rows, `w2`
    [E_local, hidden, I_local] its down projection; each rank reads only those slices of the checkpoint. After
    `to_fp8` both are float8_e4m3fn with float32 scales `w13_scale`, `w2_scale`: one per expert and row, or one
    per `weight_block` tile of each expert's matrix.

    A static FP8 checkpoint's experts each carry an activation scale per projection (`input_scale`); the block
    keeps the largest of its experts' for each product (`w13_input_scale`: gate and up, one input quantized once;
    `w2_input_scale`: down), 0-d float32, None for dynamic activations. One scale per product, as vLLM takes it:
    the grouped products quantize their whole input at once, whichever expert a row goes to. Every tensor
    parallel rank reads every expert, so all hold the same scales; under expert parallel a rank would see only
    its own experts', so static experts are refused there.
    """

    def __init__(self, spec: ModelSpec, rank: int, tp_size: int, expert_parallel: bool):
        super().__init__()
        moe = spec.moe
        self.moe, self.tp_size = moe, tp_size
        hidden = spec.hidden_size
        if expert_parallel:
            self.num_local, self.units = moe.num_experts // tp_size, moe.intermediate_size
            self.first_expert: int | None = rank * self.num_local
            self.unit_start = 0
        else:
            self.num_local, self.units = moe.num_experts, moe.intermediate_size // tp_size
            self.first_expert = None
            self.unit_start = rank * self.units
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.units, hidden), requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, self.units), requires_grad=False)
        self.w2.weight_loader = self._load_w2
        # Beside FP8 experts, set by to_fp8: float32 [E_local, rows], or [E_local, rows / tile rows, cols / tile cols].
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.weight_block: tuple[int, int] | None = None  # the tile [rows, cols] of block scales
        self.w13_input_scale: torch.Tensor | None = None
        self.w2_input_scale: torch.Tensor | None = None
        self._static: bool | None = None  # whether the experts loaded so far carry input scales
        # The scale each row this rank holds is stored with in the checkpoint, where each has one (per tensor or
        # channel), by (w13 or w2, local expert, gate or up): to_fp8 requantizes the rows at them.
        self._row_scales: dict[tuple[str, int, int | None], torch.Tensor | None] = {}

    def checkpoint_names(self, prefix: str) -> dict[str, tuple[str, Any]]:
        """checkpoint tensor name -> (parameter name, shard) for the tensors this rank reads: the router and its
        local experts' projections (`prefix` is this module's name; the checkpoint's block may be named
        otherwise, e.g. Mixtral's block_sparse_moe)."""
        names: dict[str, tuple[str, Any]] = {
            f"{self._checkpoint_block(prefix)}.gate.weight": (f"{prefix}.gate.weight", None)
        }
        first = self.first_expert or 0
        for local in range(self.num_local):
            names.update(self._expert_names(prefix, first + local, local))
        return names

    def foreign_expert_names(self, prefix: str) -> set[str]:
        """The checkpoint names of the experts other ranks hold (expert parallel; none otherwise): a weight update
        names every expert, and each rank takes its own (workers/weight_update.py)."""
        first = self.first_expert or 0
        foreign = [e for e in range(self.moe.num_experts) if not first <= e < first + self.num_local]
        return {name for e in foreign for name in self._expert_names(prefix, e, None)}

    def _checkpoint_block(self, prefix: str) -> str:
        return f"{prefix.rpartition('.')[0]}.{self.moe.block_name}"

    def _expert_names(self, prefix: str, expert: int, local: int | None) -> dict[str, tuple[str, Any]]:
        """Expert `expert`'s three checkpoint names -> (parameter, shard), its shards at local index `local`."""
        gate, up, down = self.moe.expert_names
        base = f"{self._checkpoint_block(prefix)}.experts.{expert}"
        return {
            f"{base}.{gate}.weight": (f"{prefix}.w13", (local, 0)),
            f"{base}.{up}.weight": (f"{prefix}.w13", (local, 1)),
            f"{base}.{down}.weight": (f"{prefix}.w2", (local, None)),
        }

    def expert_modules(self, prefix: str) -> list[str]:
        """The checkpoint modules (as quantization_config names them) whose weights this rank's experts hold: each
        local expert's gate, up and down projections; not the router."""
        router = f"{prefix}.gate.weight"
        return [
            name.removesuffix(".weight")
            for name, (param, _) in self.checkpoint_names(prefix).items()
            if param != router
        ]

    def tiles_cut(self, block: tuple[int, int]) -> str | None:
        """Why this rank's experts, tiled from each matrix's first row and column, would not lay their tiles on the
        checkpoint's, or None: then requantized per tile they hold the checkpoint's FP8 values and scales. w13
        stacks this rank's units of gate then of up, so both halves start on a tile only when the units' count
        (and so their start, rank * units) is a multiple of the tile's rows: a ragged last tile of gate would
        share a tile with up's first rows. w2's columns are those units, cut unless they start on a tile and
        end on one or at the last unit."""
        rows, cols = block
        start, end, total = self.unit_start, self.unit_start + self.units, self.moe.intermediate_size
        if self.units % rows:
            what = "rows of gate, then of up"
        elif start % cols or (self.units % cols and end < total):
            what = "columns of down"
        else:
            return None
        return f"this rank's units {start}..{end} of each expert's {total} ({what}) cut the {rows}x{cols} blocks"

    def to_fp8(self, block: tuple[int, int] | None) -> None:
        """w13 and w2 requantized into float8_e4m3fn from their dequantized values, per expert and output row
        (`block` None) or per `block` tile of each expert's matrix (where `tiles_cut` has no reason against it);
        then `forward` runs FP8 products. One expert at a time: the conversion needs this layer's FP8 experts and
        one expert's temporaries beside the model. Per row, each row takes the scale the checkpoint stored it with
        where every row has one, else its largest magnitude / 448; then, tensor parallel, w2 holding some columns
        of each row, its rows' scales are the whole rows' (reduced over the group), so the ranks together hold what
        one rank would."""
        amax13 = amax2 = None
        scales = self._row_scales.values()
        if block is None and len(scales) == 3 * self.num_local and all(r is not None for r in scales):
            # Each row at the scale the checkpoint stored it with: its FP8 values come back exactly (a per-tensor
            # checkpoint's too, which the rows' own maxima would round a second time, onto other grids).
            amax13, amax2 = (self._checkpoint_amax(param) for param in ("w13", "w2"))
        elif block is None and self.first_expert is None and self.tp_size > 1:
            amax2 = torch.stack([w.abs().amax(dim=1, keepdim=True) for w in self.w2.detach()]).float()
            dist.all_reduce(amax2, op=dist.ReduceOp.MAX, group=tp_group())
        w13, self.w13_scale = quantize_experts(self.w13.detach(), block, amax13)
        w2, self.w2_scale = quantize_experts(self.w2.detach(), block, amax2)
        # The FP8 parameters keep the loaders: a weight update (workers/weight_update.py) stages through them.
        self.w13, self.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
        self.w13.weight_loader, self.w2.weight_loader = self._load_w13, self._load_w2
        self.weight_block = block

    def _checkpoint_amax(self, param: str) -> torch.Tensor:
        """[E_local, rows, 1] float64: the largest magnitude each of `param`'s rows would have at its checkpoint
        scale (448 times it), what quantize_experts divides back into exactly that scale."""
        halves = (0, 1) if param == "w13" else (None,)
        rows = [torch.cat([self._row_scales[param, e, h] for h in halves]) for e in range(self.num_local)]
        return torch.stack(rows).double()[:, :, None].to(self.w13.device) * FP8_MAX

    def _load_w13(self, param: nn.Parameter, tensor: TensorSlice, name: str, shard: tuple[int, int]) -> None:
        local, half = shard
        check_shape(name, tensor, (self.moe.intermediate_size, param.shape[2]))
        self.w13_input_scale = self._largest_input_scale(name, tensor, self.w13_input_scale)
        self._row_scales["w13", local, half] = checkpoint_row_scales(
            tensor, self.unit_start, self.unit_start + self.units
        )
        rows = tensor[self.unit_start : self.unit_start + self.units]
        param.data[local, half * self.units : (half + 1) * self.units].copy_(rows)

    def _load_w2(self, param: nn.Parameter, tensor: TensorSlice, name: str, shard: tuple[int, None]) -> None:
        check_shape(name, tensor, (param.shape[1], self.moe.intermediate_size))
        self.w2_input_scale = self._largest_input_scale(name, tensor, self.w2_input_scale)
        self._row_scales["w2", shard[0], None] = checkpoint_row_scales(tensor, 0, param.shape[1])
        param.data[shard[0]].copy_(tensor[:, self.unit_start : self.unit_start + self.units])

    def _largest_input_scale(self, name: str, tensor: TensorSlice, largest: torch.Tensor | None) -> torch.Tensor | None:
        """The larger of `largest` and expert weight `name`'s static input scale; ValueError where its experts are
        static in part, or static under expert parallel."""
        scale = static_input_scale(tensor, self.w13.device)
        if self._static is None:
            self._static = scale is not None
        if self._static != (scale is not None):
            raise ValueError(
                f"weight {name}: some experts of this MoE block have a static activation scale (input_scale) and "
                "others not, and the experts' products quantize their input once for all of them"
            )
        if scale is None:
            return None
        if self.first_expert is not None:
            raise ValueError(
                f"weight {name} has a static activation scale (input_scale): with --enable-expert-parallel a rank "
                "holds only its own experts' scales, and every rank must quantize with the largest of all; serve "
                "this checkpoint without expert parallel"
            )
        return scale if largest is None else torch.maximum(largest, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.moe.top_k, self.moe.renormalize)
        out = fused_moe(
            x,
            self.w13,
            self.w2,
            weights,
            ids,
            self.first_expert,
            self.w13_scale,
            self.w2_scale,
            self.weight_block,
            self.w13_input_scale,
            self.w2_input_scale,
        )
        if self.tp_size > 1:
            dist.all_reduce(out, group=tp_group())  # this pipeline stage's ranks only
        return out
