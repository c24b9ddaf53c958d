"""raylm as a wheel installs it, away from any checkout: `raylm bench` runs from the installed files, and the
vllm-side scripts the benches run in vllm's venv are inside the install."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.test_layout import ROOT, shipped_rooms

VLLM_SCRIPTS = ("vllm_throughput.py", "vllm_spec.py", "vllm_bench_serve.py")


def _run(*cmd, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert out.returncode == 0, f"{cmd}: {out.stdout}\n{out.stderr}"
    return out


def test_raylm_bench_runs_from_the_installed_wheel_and_finds_its_vllm_scripts(tmp_path):
    # Built from a copy of what the wheel ships, so the build's own files (build/, *.egg-info) stay out of the
    # checkout; installed with --target, as the venv's editable install would otherwise answer the imports.
    source, site, elsewhere = tmp_path / "source", tmp_path / "site", tmp_path / "elsewhere"
    for room in shipped_rooms():
        shutil.copytree(ROOT / room, source / room, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input")
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("raylm-*.whl")
    _run(*pip, "install", "--no-deps", "--target", str(site), str(wheel))
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    help_text = _run(str(site / "bin" / "raylm"), "bench", "throughput", "--help", cwd=elsewhere, env=env).stdout
    assert "--num-requests" in help_text and "--max-num-seqs" in help_text  # its own flags and the engine's
    code = (
        "import bench, cli; from bench.vllm import vllm_script; "
        f"print(bench.__file__, cli.__file__, *(vllm_script(n) for n in {VLLM_SCRIPTS}))"
    )
    paths = [Path(p) for p in _run(sys.executable, "-c", code, cwd=elsewhere, env=env).stdout.split()]
    assert all(p.is_relative_to(site) for p in paths), paths
    assert [p.name for p in paths[2:]] == list(VLLM_SCRIPTS) and all(p.is_file() for p in paths[2:])
