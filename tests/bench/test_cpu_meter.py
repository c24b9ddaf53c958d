"""The CPU meter of `raylm bench serve`: it finds every process of a server's session, and only those, by kind, and
counts a process started during the window from zero."""

import os
import signal
import subprocess
import sys
import time

from bench.cpu_meter import CpuMeter, cpu_report, process_kind

BURN_CPU_S = 0.3

PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])
time.sleep(600)
"""
# Burns BURN_CPU_S of CPU once the test says go (so all of it falls in the window), then says done and idles.
BURN = f"""
import os, sys, time
d = sys.argv[1]
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.01)
t0 = time.process_time()
while time.process_time() - t0 < {BURN_CPU_S}:
    pass
open(os.path.join(d, "done"), "w").close()
time.sleep(600)
"""


def test_process_kind_names_ray_workers_retitled_processes_modules_scripts_and_programs():
    assert process_kind(["ray::WorkerActor"]) == "WorkerActor"
    assert process_kind(["ray::ServeController.listen_for_change"]) == "ServeController"
    assert process_kind(["ray::ServeReplica:raylm:LLMServer"]) == "ServeReplica:raylm:LLMServer"
    assert process_kind(["VLLM::EngineCore"]) == "VLLM::EngineCore"
    assert process_kind(["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "1"]) == (
        "vllm.entrypoints.openai.api_server"
    )
    assert process_kind(["/v/bin/python3.11", "-u", "/r/ray/_private/log_monitor.py", "--x"]) == "log_monitor.py"
    assert process_kind(["/r/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/s"]) == "raylet"
    assert process_kind(["ray::IDLE some padding"]) == "IDLE"


def test_the_meter_counts_every_process_of_the_session_and_nothing_else(tmp_path):
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "burn.py").write_text(BURN)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "burn.py"), str(tmp_path)],
        start_new_session=True,
    )
    try:
        meter = CpuMeter(proc.pid)
        meter.start()
        (tmp_path / "go").touch()
        deadline = time.monotonic() + 60
        while not (tmp_path / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        by_kind = meter.stop()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # The child may have started after start(): it counts from zero. /proc's ticks lag process_time a little.
    assert set(by_kind) == {"parent.py", "burn.py"}
    assert BURN_CPU_S * 0.8 <= by_kind["burn.py"] < BURN_CPU_S + 1.0
    assert by_kind["parent.py"] < by_kind["burn.py"]


def test_the_report_is_per_thousand_output_tokens_and_separates_the_model_processes():
    report = cpu_report({"WorkerActor": 3.0, "raylet": 0.5, "haproxy": 1.0}, output_tokens=2000)
    assert report["by_kind"] == {"WorkerActor": 1.5, "haproxy": 0.5, "raylet": 0.25}
    assert report["total"] == 2.25
    assert report["outside_model"] == 0.75
