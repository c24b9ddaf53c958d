"""`raylm bench serve --client vllm`: the load generator is vllm's own, `vllm bench serve`, unmodified.

It is the client users and papers run, and it is heavier than ours (text prompts, its tokenizer on every chunk,
one Python process on the server's machine), so a server that wins only under a light client is found out. It
runs from the vllm venv (bench/vllm.py) through vllm_scripts/vllm_bench_serve.py, against either server
alike: its random dataset (text prompts made from random token ids), the openai completions backend (streamed,
``include_usage``), ``ignore_eos``. The CPU meter covers its timed run only: it starts when the client says
"Starting main benchmark run" (after its start-up and its one-request test) and stops at its result.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

from bench.cpu_meter import CpuMeter, cpu_report

TIMEOUT_S = 3600
MAIN_RUN = "Starting main benchmark run"
RESULT = "Serving Benchmark Result"


def vllm_client_args(url: str, model: str, tokenizer: str, work_args: dict, seed: int, result: Path) -> list[str]:
    """`vllm bench serve`'s arguments for the workload `raylm bench serve` was given (random: fixed lengths)."""
    rate = work_args.get("request_rate", math.inf)
    return [
        *("--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", model, "--tokenizer", tokenizer),
        *("--dataset-name", "random", "--random-range-ratio", "0"),
        *("--random-input-len", str(work_args.get("input_len", 128))),
        *("--random-output-len", str(work_args.get("output_len", 128))),
        *("--num-prompts", str(work_args.get("num_requests", 64))),
        *("--request-rate", "inf" if math.isinf(rate) else f"{rate:g}"),
        *("--ignore-eos", "--seed", str(seed), "--disable-tqdm"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
        *("--save-result", "--result-dir", str(result.parent), "--result-filename", result.name),
    ]


def run_vllm_client(
    name: str,
    url: str,
    model: str,
    tokenizer: str,
    work_args: dict,
    seed: int,
    meter: CpuMeter | None,
    api_key: str | None = None,
) -> dict:
    """Run `vllm bench serve` against ``url``; return its row in `raylm bench serve`'s form."""
    from bench.vllm import vllm_script, vllm_venv

    py = vllm_venv() / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="raylm-vllm-client-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            str(py),
            str(vllm_script("vllm_bench_serve.py")),
            *vllm_client_args(url, model, tokenizer, work_args, seed, result),
        ]
        lines, cpu = _run_metered(cmd, meter, api_key)
        if not result.exists():
            tail = "\n".join(lines[-30:])
            raise RuntimeError(f"vllm bench serve against {name} wrote no result; its output ended with:\n{tail}")
        data = json.loads(result.read_text())
    row = row_from_result(name, data)
    row["cpu"] = cpu_report(cpu, data["total_output_tokens"]) if meter else None
    return row


def _run_metered(cmd: list[str], meter: CpuMeter | None, api_key: str | None) -> tuple[list[str], dict[str, float]]:
    """Run the client, the meter around its timed run; its output lines (shown only on failure)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if api_key:  # vllm's client sends $OPENAI_API_KEY as the bearer token
        env["OPENAI_API_KEY"] = api_key
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    cpu: dict[str, float] = {}
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if meter and MAIN_RUN in line:
                meter.start()
            elif meter and RESULT in line:
                cpu = meter.stop()
        proc.wait(TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return lines, cpu


def row_from_result(name: str, data: dict) -> dict:
    """`vllm bench serve`'s saved result as a row of `raylm bench serve` (print_row, the ratios)."""
    return {
        "name": name,
        "duration_s": data["duration"],
        "completed": data["completed"],
        "num_requests": data["num_prompts"],
        "output_throughput": data["output_throughput"],
        "total_throughput": data["total_token_throughput"],
        "chunks_per_s": None,
        "tokens_per_chunk": None,
        "steps_per_s": None,
        **{
            key: {stat: data[f"{stat}_{key}_ms"] for stat in ("mean", "median", "p99")}
            for key in ("ttft", "tpot", "itl", "e2el")
        },
    }
