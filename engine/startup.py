"""Starting an engine's ranks: one worker actor per rank in its bundle, then on every rank its threads (bound to
cores as cpu_omp_threads_bind plans), its device, the process group, its model shard and a KV cache of the same
size."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.config.derive import steps_in_flight
from engine.network import free_port, interface_of
from engine.worker_actor import KV_TRANSFERS, LORA_READS, OverlappingWorkerActor, WorkerActor, share_node_gpus

if TYPE_CHECKING:
    from workers.worker import WorkerConfig

# A thread of its own reads LoRA adapters from disk while the default one runs steps (worker_actor.py).
RayWorker = ray.remote(concurrency_groups={LORA_READS: 1, KV_TRANSFERS: 1})(WorkerActor)
OverlappingRayWorker = ray.remote(concurrency_groups={LORA_READS: 1, KV_TRANSFERS: 1})(OverlappingWorkerActor)
SOCKET_IFNAME = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


@dataclass(slots=True)
class NodeInfo:
    """Where a rank landed: what thread counts and the process-group address are derived from."""

    node_id: str
    ip: str
    num_cores: int  # cores this process may run on (not Ray's logical CPUs, which only count reservations)
    free_port: int
    ifname: str | None  # the interface holding ``ip``, when one does
    cores: list[int]  # those cores' ids
    primary_cores: list[int]  # one of them per physical core (workers.cpu_binding.primary_cores)


def _node_info(_actor: WorkerActor) -> NodeInfo:
    """Runs inside a rank's actor (through ``__ray_call__``)."""
    from workers.cpu_binding import primary_cores

    ip = ray.util.get_node_ip_address()
    cores = sorted(os.sched_getaffinity(0))
    return NodeInfo(
        ray.get_runtime_context().get_node_id(),
        ip,
        len(cores),
        free_port(),
        interface_of(ip),
        cores,
        primary_cores(cores),
    )


def _socket_ifname(_actor: WorkerActor, var: str, default: str | None) -> str | None:
    """Runs inside a rank's actor: the interface ``var`` names for the backend, set to ``default`` first when
    the environment leaves it unset."""
    if not os.environ.get(var) and default:
        os.environ[var] = default
    return os.environ.get(var)


def _init_device(actor: WorkerActor, num_threads: int, cores: list[int] | None) -> str:
    """Runs inside a rank's actor: fix its torch thread count (Ray's OMP_NUM_THREADS follows num_cpus), take its
    device, then bind its threads to ``cores`` (one each) if given."""
    actor.worker.config.num_threads = num_threads
    device = actor.worker.init_device()
    if cores:
        from workers.cpu_binding import bind_threads

        bind_threads(cores)
    return device


def thread_binding(infos: list[NodeInfo], spec: str, num_threads: int | None, on_gpu: bool) -> list[list[int] | None]:
    """Per rank, the cores its threads bind to (None: left alone), planned per node for the ranks there in rank
    order (workers/cpu_binding.py); ValueError for a binding a node cannot honour."""
    from workers.cpu_binding import plan_binding

    per_rank: list[list[int] | None] = [None] * len(infos)
    for node in dict.fromkeys(i.node_id for i in infos):
        ranks = [r for r, i in enumerate(infos) if i.node_id == node]
        first = infos[ranks[0]]
        plan = plan_binding(spec, first.cores, first.primary_cores, len(ranks), num_threads, on_gpu, f"node {first.ip}")
        for r, cores in zip(ranks, plan or [None] * len(ranks)):
            per_rank[r] = cores
    return per_rank


def start_workers(config: EngineConfig, pg: PlacementGroup, first_bundle: int, device: str) -> list:
    """Rank r (tensor-parallel rank r % tp of stage r // tp) goes to bundle ``first_bundle + 1 + r``
    (``first_bundle`` is the scheduler's); each starts its process, to be configured by init_workers. With two
    steps in flight and one stage, a rank overlaps its steps (OverlappingWorkerActor); a pipeline's stages run
    theirs one at a time, since each stage's next step waits on the link anyway."""
    overlap = config.pipeline_parallel_size == 1 and steps_in_flight(config, device == "cuda") > 1
    actor = OverlappingRayWorker if overlap else RayWorker
    return [
        actor.options(
            num_cpus=config.num_threads or 1,
            num_gpus=1 if device == "cuda" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + 1 + r),
        ).remote(r)
        for r in range(config.world_size)
    ]


def init_workers(
    workers: list,
    worker_config: WorkerConfig,
    num_threads: int | None,
    device: str,
    timeout_s: float,
    cpu_binding: str = "auto",
) -> tuple[int, int, list[NodeInfo]]:
    """``worker_config`` on ``device``, then device, process group, model shard and KV cache on every rank; returns
    the blocks each rank holds (device, host tier) and where each rank runs. The ranks must form their process
    group within ``timeout_s``."""
    wcfg = dataclasses.replace(worker_config, device=device)
    ray.get([w.configure.remote(wcfg) for w in workers])
    infos: list[NodeInfo] = ray.get([w.__ray_call__.remote(_node_info) for w in workers])
    ranks_per_node = Counter(i.node_id for i in infos)
    binding = thread_binding(infos, cpu_binding, num_threads, device == "cuda")
    # Co-located ranks share their node's cores: oversubscribed torch threads stall at every barrier.
    threads = [
        len(cores) if cores else num_threads or max(1, i.num_cores // ranks_per_node[i.node_id])
        for i, cores in zip(infos, binding)
    ]
    share_node_gpus(workers, [i.node_id for i in infos])
    ray.get([w.__ray_call__.remote(_init_device, n, c) for w, n, c in zip(workers, threads, binding)])
    form_process_group(workers, infos, "nccl" if device == "cuda" else "gloo", timeout_s)
    ray.get([w.call.remote("load_model") for w in workers])
    num_blocks = min(ray.get([w.call.remote("determine_num_blocks") for w in workers]))
    if num_blocks < 2:
        block_bytes = ray.get(workers[0].call.remote("block_bytes"))
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_bytes} bytes; raise kv_cache_bytes "
            f"or gpu_memory_utilization"
        )
    num_host_blocks = min(ray.get([w.call.remote("determine_num_host_blocks") for w in workers]))
    ray.get([w.call.remote("init_cache", num_blocks, num_host_blocks) for w in workers])
    return num_blocks, num_host_blocks, infos


def form_process_group(workers: list, infos: list[NodeInfo], backend: str, timeout_s: float) -> None:
    """Join every rank to the process group at rank 0's node IP (the one Ray uses, so the other nodes reach
    it), or raise RuntimeError naming the interface setting: a rank listening where the others cannot reach
    fails deep in gloo, or waits out the group's 300 s timeout."""
    # Gloo's default is the address the host name resolves to: often a loopback (127.0.1.1 on Debian) or an
    # interface the other nodes cannot reach. So unless told otherwise, gloo listens on the interface holding
    # the node's Ray IP. NCCL picks its interfaces by its own rules, unless NCCL_SOCKET_IFNAME says.
    var = SOCKET_IFNAME[backend]
    ifnames = ray.get(
        [
            w.__ray_call__.remote(_socket_ifname, var, i.ifname if backend == "gloo" else None)
            for w, i in zip(workers, infos)
        ]
    )
    master = infos[0]
    refs = [
        w.call.remote("init_distributed", rank, len(workers), master.ip, master.free_port, backend)
        for rank, w in enumerate(workers)
    ]
    try:
        ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as e:
        why = (
            f"not within placement_timeout_s={timeout_s:g}"
            if isinstance(e, ray.exceptions.GetTimeoutError)
            else str(e.cause).strip().splitlines()[-1][-300:]
        )
        ranks = "; ".join(
            f"rank {r} on node {i.ip}, {var}={n or 'unset'}" for r, (i, n) in enumerate(zip(infos, ifnames))
        )
        raise RuntimeError(
            f"the {len(workers)} ranks did not form their {backend} process group at tcp://{master.ip}:"
            f"{master.free_port} ({ranks}): {why}. Each rank listens on the interface {var} names, so every node "
            f"must reach the others there. Set {var} to the interface that holds each node's Ray IP, in the "
            f"environment `ray start` runs in (docs/multinode.md), and let that traffic through the nodes' "
            f"firewalls"
        ) from None
