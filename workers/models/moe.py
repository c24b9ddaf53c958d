"""The mixture-of-experts feed-forward of Qwen3-MoE and Mixtral, split over the tensor-parallel group."""

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.moe import fused_moe, route
from workers.layers import TensorSlice, check_shape
from workers.model_spec import ModelSpec
from workers.parallel import tp_group


class SparseMoeBlock(nn.Module):
    """Router (replicated) and experts, over `tp_size` ranks in one of two ways. Tensor parallel (default):
    every rank holds units [rank * I/tp, (rank + 1) * I/tp) of every expert. Expert parallel: rank r holds
    experts [r * E/tp, (r + 1) * E/tp) whole. Either way every rank routes every token (its activations are
    replicated after attention's all-reduce), computes the share its weights allow, and one all-reduce of
    [T, hidden] sums the shares: the same collective as a dense MLP's down projection.

    `w13` [E_local, 2 * I_local, hidden] holds each local expert's gate rows then up rows, `w2`
    [E_local, hidden, I_local] its down projection; each rank reads only those slices of the checkpoint.
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

    def checkpoint_names(self, prefix: str) -> dict[str, tuple[str, Any]]:
        """checkpoint tensor name -> (parameter name, shard) for the tensors this rank reads: the router and its
        local experts' projections (`prefix` is this module's name; the checkpoint's block may be named
        otherwise, e.g. Mixtral's block_sparse_moe)."""
        ckpt = f"{prefix.rpartition('.')[0]}.{self.moe.block_name}"
        gate, up, down = self.moe.expert_names
        names: dict[str, tuple[str, Any]] = {f"{ckpt}.gate.weight": (f"{prefix}.gate.weight", None)}
        for local in range(self.num_local):
            expert = f"{ckpt}.experts.{(self.first_expert or 0) + local}"
            names[f"{expert}.{gate}.weight"] = (f"{prefix}.w13", (local, 0))
            names[f"{expert}.{up}.weight"] = (f"{prefix}.w13", (local, 1))
            names[f"{expert}.{down}.weight"] = (f"{prefix}.w2", (local, None))
        return names

    def _load_w13(self, param: nn.Parameter, tensor: TensorSlice, name: str, shard: tuple[int, int]) -> None:
        local, half = shard
        check_shape(name, tensor, (self.moe.intermediate_size, param.shape[2]))
        rows = tensor[self.unit_start : self.unit_start + self.units]
        param.data[local, half * self.units : (half + 1) * self.units].copy_(rows)

    def _load_w2(self, param: nn.Parameter, tensor: TensorSlice, name: str, shard: tuple[int, None]) -> None:
        check_shape(name, tensor, (param.shape[1], self.moe.intermediate_size))
        param.data[shard[0]].copy_(tensor[:, self.unit_start : self.unit_start + self.units])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.moe.top_k, self.moe.renormalize)
        out = fused_moe(x, self.w13, self.w2, weights, ids, self.first_expert)
        if self.tp_size > 1:
            dist.all_reduce(out, group=tp_group())  # this pipeline stage's ranks only
        return out
