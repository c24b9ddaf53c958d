"""raylm's native CPU ops (csrc/cpu_ops.cpp), built on first use for this machine: decode attention straight
from the paged cache, the Llama block's elementwise ops fused into one pass each, the products of few rows
with many weights (a decode step's linear layers and MoE experts), and the sampler's top-p cut and its draw of a
token per row.

torch's extension builder compiles them once per machine (about a minute; later processes load the cached
library, and concurrent ones wait for the one building). Where they cannot be built (no C++ compiler),
`load_cpu_ops` is False: attention takes SDPA for decodes and the fused ops below their torch equivalents.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# -march=native is safe because each CPU kind gets its own build directory (_build_dir).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

_loaded = False
_tried = False


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pinned ninja wheel's binary is there only in an
    activated venv, so name its folder when no other ninja is found."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _cpu_fingerprint() -> str:
    """The CPU's feature flags, hashed: a -march=native build is only valid on CPUs with the same ones."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _build_dir() -> str:
    cache = Path(os.environ.get("RAYLM_CACHE_DIR") or Path.home() / ".cache" / "raylm")
    # Keyed by CPU features as well: a home directory shared between nodes of different CPUs holds one build each;
    # by the source, so that checkouts of different versions never rebuild (and rewrite) each other's library; and
    # by the torch it builds against, whose headers and libraries the build names by path: two virtual environments
    # sharing a home rebuilt the one directory (~30 s) each time the other had loaded it.
    source = hashlib.sha256(SOURCE.read_bytes() + str(Path(torch.__file__).parent).encode()).hexdigest()[:12]
    path = cache / "torch_extensions" / f"{os.uname().machine}-{_cpu_fingerprint()}-{source}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def load_cpu_ops() -> bool:
    """Whether `torch.ops.raylm` (paged_decode and the fused ops) is loaded, building it if needed; False
    (logged once) where it cannot be built. Set RAYLM_NATIVE_DECODE=0 to never build or use it."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get("RAYLM_NATIVE_DECODE", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        build_dir = Path(_build_dir())
        with open(build_dir / "build.flock", "w") as held:
            # torch's builder marks a build with a `lock` file and waits while one exists; a build killed midway
            # (Ctrl-C during the first start) leaves it, and every later start waited forever. This lock the
            # kernel drops with its process, so while it is held no build runs, and a `lock` file is stale.
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            if not (build_dir / "raylm_cpu_ops.so").exists():  # else a load of seconds: nothing to say
                # a first start is otherwise silent for the build's ~25 s (longer on a loaded machine)
                print(f"raylm: building the native CPU ops for this machine, once, into {build_dir}", file=sys.stderr)
            load(
                name="raylm_cpu_ops",
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        _loaded = True
    except Exception as e:
        logger.warning("raylm: the native CPU ops could not be built (%s: %s); using torch's", type(e).__name__, e)
    return _loaded


def _native(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and load_cpu_ops()


def small_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch.ops.raylm.small_mm(x, w)` (and `grouped_small_mm`) can take these operands."""
    return (
        _native(x) and w.dtype == torch.float32 and w.device.type == "cpu" and x.is_contiguous() and w.is_contiguous()
    )


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then RMSNorm of the sum: one pass per row on CPU."""
    if _native(x) and x.is_contiguous() and residual.is_contiguous():
        return torch.ops.raylm.add_rms_norm(x, residual, weight, eps)
    residual += x
    return F.rms_norm(residual, weight.shape, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up for x = [gate | up] along the last dimension."""
    if _native(x) and x.is_contiguous() and x.dim() == 2:
        return torch.ops.raylm.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate each head of x [T, heads, D] in place, Neox style, by cos and sin [T, D/2] (or [T, 1, D/2])."""
    if _native(x) and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
        torch.ops.raylm.rotary_(x, cos, sin)
        return
    cos, sin = cos.view(x.shape[0], 1, -1), sin.view(x.shape[0], 1, -1)
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def sample_categorical(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row i of ``weights`` [S, V] (nonnegative, any total), the draw from the categorical distribution they
    weight at ``uniforms[i]`` in [0, 1): the first token whose cumulative weight exceeds uniforms[i] times the
    row's total, summed in float64. Always a token of positive weight (0 for a row with none)."""
    if _native(weights) and weights.is_contiguous() and weights.dim() == 2:
        return torch.ops.raylm.sample_categorical(weights, uniforms.to(torch.float64).contiguous())
    cumulative = weights.cumsum(-1, dtype=torch.float64)
    target = uniforms.to(cumulative).unsqueeze(1) * cumulative[:, -1:]
    token = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    # Rounding may leave u * total equal to the total (no token passes it): the last token of positive weight.
    positive = weights > 0
    last = weights.shape[1] - 1 - positive.flip(-1).to(torch.uint8).argmax(-1)
    return torch.where(token < weights.shape[1], token, last).where(positive.any(-1), 0)


def top_p_mask_(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-p in place: per row i of ``logits`` [S, V], -inf outside the smallest most-likely-first set of tokens
    whose probability reaches ``top_p[i]`` (in (0, 1]). A token stays when the tokens ranked above it hold less
    than top_p of the mass, so the most likely always stays. Native on CPU (a radix select; tokens tied at the cut
    stay together); elsewhere a sort of each row (ties at the cut in the sort's order)."""
    if _native(logits) and logits.is_contiguous() and logits.dim() == 2:
        torch.ops.raylm.top_p_mask_(logits, top_p.to(torch.float32).contiguous())
        return
    ascending, order = logits.sort(dim=-1)
    # Ascending, a token goes when the mass of the tokens less likely than it, itself included, fits in 1 - p.
    drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    logits.scatter_(1, order, ascending.masked_fill_(drop, float("-inf")))
