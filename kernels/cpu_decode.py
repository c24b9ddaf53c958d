"""The native CPU decode-attention op (csrc/paged_decode.cpp), built on first use for this machine.

torch's extension builder compiles it once per machine (about half a minute; later processes load
the cached library, and concurrent ones wait on the builder's lock). Where it cannot be built (no
C++ compiler), `paged_decode` is None and the torch path attends decodes with SDPA instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# -march=native is safe because each CPU kind gets its own build directory (_build_dir).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

_loaded: Callable | None = None
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
    # Keyed by CPU features as well: a home directory shared between nodes of different CPUs holds one build each.
    path = cache / "torch_extensions" / f"{os.uname().machine}-{_cpu_fingerprint()}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def load_paged_decode() -> Callable | None:
    """`torch.ops.raylm.paged_decode`, building it if needed; None (logged once) where it cannot be built.
    Set RAYLM_NATIVE_DECODE=0 to never build or use it."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get("RAYLM_NATIVE_DECODE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        load(name="raylm_paged_decode", sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             build_directory=_build_dir(), is_python_module=False, verbose=False)
        _loaded = torch.ops.raylm.paged_decode
    except Exception as e:  # noqa: BLE001 - any build failure means: use SDPA
        logger.warning("raylm: the native CPU decode kernel could not be built (%s: %s); decodes use SDPA",
                       type(e).__name__, e)
    return _loaded
