"""The Llama block's elementwise ops, each in one pass where the device has a kernel for it: raylm's native ops on
CPU (kernels/cpu_ops.py), Triton's on CUDA (kernels/triton_fused.py), else torch's ops.

On CUDA a tensor the Triton kernels do not take (a dtype other than fp32/fp16/bf16, a layout with strided
columns, a shape or layout an op's kernel is not written for) takes torch's ops, and the reason is logged once. `RAYLM_FUSED_KERNELS=0` keeps CUDA on torch's ops,
for profiling a step with and without the fusions in one process (`raylm bench profile`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.formats import TRITON_DTYPES

logger = logging.getLogger(__name__)
_logged: set[str] = set()


@functools.cache
def has_triton() -> bool:
    """Whether triton is installed (looked up once: the eager step asks for every op of every layer)."""
    return importlib.util.find_spec("triton") is not None


def on_triton(t: torch.Tensor) -> bool:
    """Whether ops on `t` dispatch to raylm's Triton kernels: a CUDA tensor, with triton installed. Every kernel
    module asks this one function (through this module, not a copy of the name), so a CPU test can take the CUDA
    dispatch whole under Triton's interpreter (tests/workers/test_decode_graphs.py)."""
    return t.is_cuda and has_triton()


def _unfused_reason(tensors: tuple[torch.Tensor, ...]) -> str | None:
    """Why the Triton kernels cannot take these CUDA tensors, or None when they can."""
    if os.environ.get("RAYLM_FUSED_KERNELS", "1") == "0":
        return "RAYLM_FUSED_KERNELS=0"
    if not has_triton():
        return "triton is not installed"
    for t in tensors:
        if t.dtype not in TRITON_DTYPES:
            return f"dtype {t.dtype} (the fused kernels take {', '.join(str(d) for d in TRITON_DTYPES)})"
        if t.stride(-1) != 1:
            return f"a tensor of shape {list(t.shape)} with strides {list(t.stride())} (last dimension strided)"
    return None


def _use_triton(op: str, *tensors: torch.Tensor, why_not: str | None = None) -> bool:
    """`why_not`: the op's own reason its kernel cannot take these tensors (a shape, a layout), or None."""
    return on_triton(tensors[0]) and _triton_takes(op, tensors, why_not)


def _triton_takes(op: str, tensors: tuple[torch.Tensor, ...], why_not: str | None) -> bool:
    """Whether the Triton kernel of `op` takes these tensors; if not, the reason is logged, once per op."""
    reason = _unfused_reason(tensors) or why_not
    if reason is None:
        return True
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        logger.warning("raylm: %s runs unfused on CUDA: %s", op, reason)
    return False


def _not_2d(x: torch.Tensor) -> str | None:
    return None if x.dim() == 2 else f"a {x.dim()}-D input of shape {list(x.shape)} (the kernel takes [tokens, width])"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton("rms_norm", x, weight, why_not=_not_2d(x)):
        from kernels.triton_fused import rms_norm

        return rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then RMSNorm of the sum."""
    why_not = _not_2d(x) or (None if residual.is_contiguous() else "a residual that is not contiguous")
    if _use_triton("add_rms_norm", x, residual, weight, why_not=why_not):
        from kernels.triton_fused import rms_norm

        return rms_norm(x, weight, eps, residual)
    return cpu_ops.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up for x = [gate | up] along the last dimension."""
    if _use_triton("silu_and_mul", x, why_not=_not_2d(x)):
        from kernels.triton_fused import silu_and_mul

        return silu_and_mul(x)
    return cpu_ops.silu_and_mul(x)


def rotary_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    store_kv,
) -> torch.Tensor:
    """The queries of qk [T, heads + kv_heads, D], normed per head with `qk_norm` (query weight, key weight, eps;
    None: no norm) and rotated by cos and sin [T, 1, D/2]; the keys normed and rotated alike and stored with v
    [T, kv_heads, D] into `kv_cache` at `slot_mapping`, by `store_kv` (the attention backend's) where unfused.
    Returns the queries [T, heads, D]."""
    kv_heads = kv_cache.shape[3]
    norms = qk_norm[:2] if qk_norm is not None else ()
    why_not = None if cos.is_contiguous() and sin.is_contiguous() else "cos or sin not contiguous"
    if _use_triton("rotary_store_kv", qk, v, cos, sin, *norms, why_not=why_not):
        from kernels.triton_fused import rotary_store_kv

        return rotary_store_kv(qk, v, cos, sin, kv_cache, slot_mapping, k_scale, v_scale, qk_norm)
    heads = qk.shape[1] - kv_heads
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        qk = torch.cat(
            (
                F.rms_norm(qk[:, :heads], q_weight.shape, q_weight, eps),
                F.rms_norm(qk[:, heads:], k_weight.shape, k_weight, eps),
            ),
            dim=1,
        )
    # q and k rotate by the same angles: one rotation over both, in place.
    cpu_ops.rotary_(qk, cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q
