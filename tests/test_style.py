"""The house style: ruff's lint rules and formatter (pyproject.toml's [tool.ruff]) hold over the whole tree."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, str(ROOT)], capture_output=True, text=True, timeout=120)


def test_ruff_lint_is_clean():
    out = ruff("check", "--no-cache", "--output-format", "concise")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    out = ruff("format", "--check", "--no-cache")
    assert out.returncode == 0, out.stdout + out.stderr
