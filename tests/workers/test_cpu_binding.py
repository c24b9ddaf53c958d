"""The ranks' core binding (workers/cpu_binding.py): what `auto` gives each rank, the refusals of a binding a node
cannot honour (naming the setting and the node's cores), and real threads bound in a process of their own."""

import json
import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from workers.cpu_binding import format_cores, parse_cpu_list, plan_binding, primary_cores

CORES = list(range(4))


def test_auto_binds_each_rank_to_its_own_cores_on_cpu_and_leaves_gpu_ranks_alone():
    assert plan_binding("auto", [0, 1], [0, 1], 1, None, on_gpu=False) == [[0, 1]]
    assert plan_binding("auto", CORES, CORES, 2, None, on_gpu=False) == [[0, 1], [2, 3]]
    assert plan_binding("auto", CORES, CORES, 2, 1, on_gpu=False) == [[0], [1]]
    assert plan_binding("auto", CORES, CORES, 1, None, on_gpu=True) is None
    assert plan_binding("nobind", CORES, CORES, 1, None, on_gpu=False) is None


def test_auto_leaves_hyperthread_siblings_and_on_a_large_node_one_core_to_the_serving_processes():
    sixteen = list(range(16))
    assert plan_binding("auto", sixteen, sixteen[:8], 1, None, on_gpu=False) == [list(range(7))]
    per_rank = plan_binding("auto", sixteen, sixteen, 3, None, on_gpu=False)
    assert per_rank == [list(range(5)), list(range(5, 10)), list(range(10, 15))]


def test_auto_leaves_threads_alone_where_ranks_times_threads_do_not_fit():
    assert plan_binding("auto", [0, 1], [0, 1], 2, 2, on_gpu=False) is None
    assert plan_binding("auto", [0], [0], 2, None, on_gpu=False) is None


def test_explicit_lists_bind_as_given_even_on_gpu():
    assert plan_binding("1|0", [0, 1], [0, 1], 2, None, on_gpu=True) == [[1], [0]]
    assert plan_binding("0-1,3|2", CORES, CORES, 1, None, on_gpu=False) == [[0, 1, 3]]


@pytest.mark.parametrize(
    "spec, ranks, threads, says",
    [
        ("0-5", 1, None, "names cores 4-5 that node 10.0.0.1 lacks"),
        ("0,1", 2, None, "gives cores to 1 ranks, but 2 run on node 10.0.0.1"),
        ("0|1", 2, 2, "fewer cores than ranks x threads (2 x num_threads=2)"),
    ],
)
def test_a_binding_the_node_cannot_honour_is_refused_naming_the_setting_and_the_cores(spec, ranks, threads, says):
    with pytest.raises(ValueError) as e:
        plan_binding(spec, CORES, CORES, ranks, threads, on_gpu=False, where="node 10.0.0.1")
    assert str(e.value).startswith(f"cpu_omp_threads_bind={spec!r}")
    assert says in str(e.value)
    assert "node 10.0.0.1 has cores 0-3 for its ranks" in str(e.value)


@pytest.mark.parametrize("spec", ["0-", "a", "3-1", "0,0", "0||1"])
def test_a_binding_that_is_no_core_list_is_refused_by_the_settings(spec):
    with pytest.raises(ValueError, match="cpu_omp_threads_bind="):
        EngineConfig(cpu_omp_threads_bind=spec)


def test_core_lists_read_and_print_in_the_kernels_form():
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    assert format_cores([5, 0, 2, 1]) == "0-2,5"


def test_primary_cores_take_one_logical_cpu_per_physical_core(tmp_path):
    for cpu, core in enumerate([0, 1, 0, 1]):  # cpu2 and cpu3 are cpu0's and cpu1's hyperthread siblings
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert primary_cores(CORES, tmp_path) == [0, 1]
    assert primary_cores([0, 1, 7], tmp_path) == [0, 1, 7]  # cpu7's topology is unreadable: every core counts


BIND = """
import json, os, sys
import torch
from workers.cpu_binding import bind_threads
cores = json.loads(sys.argv[1])
bind_threads(cores)
torch.ones(256, 256) @ torch.ones(256, 256)
masks = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")]
single = sorted({next(iter(a)) for a in masks if len(a) == 1})  # threads started later inherit a core too
print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "bound": single, "threads": torch.get_num_threads()}))
"""


def test_bind_threads_puts_each_torch_thread_on_its_own_core():
    cores = sorted(os.sched_getaffinity(0))[::-1][:2]  # reversed: thread 0 (this thread) on the last core
    out = subprocess.run(
        [sys.executable, "-c", BIND, json.dumps(cores)], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["main"] == [cores[0]]
    assert result["bound"] == sorted(cores)
    assert result["threads"] == len(cores)
