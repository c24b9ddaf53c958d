"""Every Triton kernel of kernels/ compiles for a GPU (Hopper, Ada, and Ampere where no float8 is involved) with
Triton's real compiler, on CPU: tests/kernels/gpu_compile.py, run in a subprocess. The other kernel tests set
TRITON_INTERPRET=1 in this process before triton's first import, and @triton.jit reads it when it decorates: here
the kernels would be interpreted, never compiled."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def launched_kernels() -> set[str]:
    """The jitted functions of kernels/ that wrappers launch: by the house convention, those named *_kernel (the
    others, such as _fold_keys, are inlined into them)."""
    pattern = re.compile(r"^@triton\.jit.*\ndef (\w+_kernel)\(", re.MULTILINE)
    return {name for path in (ROOT / "kernels").glob("*.py") for name in pattern.findall(path.read_text())}


# find_spec, not an import: importing triton here, before TRITON_INTERPRET is set, would break the other kernel tests.
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed: nothing to compile")
def test_every_triton_kernel_compiles_for_hopper_and_ada():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.gpu_compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # about a minute on 2 idle cores, several on a loaded machine
    )
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    for arch in (90, 89):
        compiled = set(re.findall(rf"^ok +sm{arch} +(\w+)", run.stdout, re.MULTILINE))
        missing = launched_kernels() - compiled
        assert not missing, f"never launched, so never compiled for sm{arch}: {sorted(missing)}\n{run.stdout}"
