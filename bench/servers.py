"""Servers a benchmark starts and stops itself: `raylm serve` and `vllm serve`, one at a time, each in a
process group of its own so that stopping it also stops what it spawned (Ray, vllm's engine core)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.cpu_meter import CpuMeter
from engine.network import free_port

START_TIMEOUT_S = 1800  # a first start builds the native CPU ops and converts the default model (vllm: compiles)
STOP_TIMEOUT_S = 60


class ServerProcess:
    """A server command running until ``stop()``: started in its own session, ready once /health answers 200.

    Its output goes to a temporary file, shown (its tail) only when it fails
    to start, so a benchmark's own figures are not lost among server logs.
    """

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"raylm-bench-{name}-", suffix=".log", delete=False)
        print(f"  starting {name}: {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode}; its log ended with:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(
            f"{self.name} did not answer {self.url}/health within {START_TIMEOUT_S} s; its log ended "
            f"with:\n{self.tail()}"
        )

    def meter(self) -> CpuMeter:
        """A meter of every process the server runs: all of them are in the session it was started in."""
        return CpuMeter(self.proc.pid)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Ctrl-C first (raylm serve deletes its app and stops its Ray), then kill the whole group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


def split_variant(variant: str) -> tuple[dict[str, str], list[str]]:
    """``"RAY_X=1 --cpu-omp-threads-bind nobind"`` -> ({"RAY_X": "1"}, ["--cpu-omp-threads-bind", "nobind"]): the
    environment assignments that lead a variant, as in a shell, then its `raylm serve` flags."""
    words = shlex.split(variant)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def raylm_server(port: int, args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    """`raylm serve` with this interpreter (so the same checkout), its own local Ray and these flags."""
    return ServerProcess(
        "raylm serve",
        [sys.executable, "-m", "cli", "serve", "--port", str(port), "--grpc-port", str(free_port()), *args],
        port,
        env,
    )


def vllm_server(port: int, model: str, served_name: str, max_num_seqs: int, num_threads: int | None) -> ServerProcess:
    """`vllm serve` from the venv `raylm bench throughput --compare vllm` builds, under raylm's engine limits
    (fp32, a 1 GiB KV cache, 2048 batched tokens, 8192-token context) and its best binding on this machine:
    every core this process may use, listed explicitly (vllm's "auto" keeps one back for its engine core,
    0.7x measured on 2 cores; vllm_scripts/vllm_throughput.py says why)."""
    from bench.vllm import vllm_venv

    venv = vllm_venv()
    cores = sorted(os.sched_getaffinity(0))[:num_threads]
    config = json.loads((Path(model) / "config.json").read_text())
    max_model_len = min(config.get("max_position_embeddings", 8192), 8192)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
    # The API server's module rather than the `vllm` command, which looks up the distribution "vllm" (this one
    # is "vllm-cpu") and fails before serving.
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--served-model-name",
        served_name,
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
        "--max-num-batched-tokens",
        "2048",
    ]
    return ServerProcess("vllm serve", cmd, port, env)
