"""The Ray engine: a placement group, one worker actor per tensor-parallel rank, and the scheduler
actor that steps them. RayEngine is its facade: InProcessEngine's synchronous interface (what the
offline LLM drives) plus an async stream of deltas (what the Serve app drives)."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import socket
import struct
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import EngineConfig
from cluster.engine import check_params, check_prompt, resolve_max_model_len, stop_token_ids
from cluster.scheduler_actor import RequestSteps, SchedulerActor
from cluster.worker_actor import WorkerActor, share_node_gpus
from scheduler import RequestOutput, SamplingParams, SchedulerStats
from workers.model_loader import read_model_spec

RayWorker = ray.remote(WorkerActor)
RaySchedulerActor = ray.remote(SchedulerActor)
SCHEDULER_CPUS = 1.0  # the scheduler's bundle; the actor mostly awaits, but Ray needs a non-empty bundle
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
SOCKET_IFNAME = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


@dataclass(slots=True)
class NodeInfo:
    """Where a rank landed: what thread counts and the process-group address are derived from."""

    node_id: str
    ip: str
    num_cores: int  # cores this process may run on (not Ray's logical CPUs, which only count reservations)
    free_port: int
    ifname: str | None  # the interface holding ``ip``, when one does


def _node_info(_actor: WorkerActor) -> NodeInfo:
    """Runs inside a rank's actor (through ``__ray_call__``)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    ip = ray.util.get_node_ip_address()
    return NodeInfo(ray.get_runtime_context().get_node_id(), ip, len(os.sched_getaffinity(0)), port,
                    interface_of(ip))


def interface_of(ip: str) -> str | None:
    """The network interface whose (primary) IPv4 address is ``ip`` on this host, or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def _socket_ifname(_actor: WorkerActor, var: str, default: str | None) -> str | None:
    """Runs inside a rank's actor: the interface ``var`` names for the backend, set to ``default`` first when
    the environment leaves it unset."""
    if not os.environ.get(var) and default:
        os.environ[var] = default
    return os.environ.get(var)


def _init_device(actor: WorkerActor, num_threads: int) -> str:
    """Runs inside a rank's actor: fix its torch thread count (Ray's OMP_NUM_THREADS follows num_cpus), then
    take its device."""
    actor.worker.config.num_threads = num_threads
    return actor.worker.init_device()


class EngineStopping(RuntimeError):
    """The engine's owner is stopping it: a request still running was ended before it finished."""


def merge_deltas(deltas: list[RequestOutput]) -> list[RequestOutput]:
    """Fold the queued deltas of each sample into one, so a consumer that lags costs one object per sample."""
    if len(deltas) == 1:
        return deltas
    by_index: dict[int, list[RequestOutput]] = {}
    for d in deltas:
        by_index.setdefault(d.index, []).append(d)
    return [group[0] if len(group) == 1 else _fold(group) for group in by_index.values()]


def _fold(group: list[RequestOutput]) -> RequestOutput:
    last = group[-1]
    logprobs = [lp for d in group for lp in d.new_logprobs or []] if any(d.new_logprobs for d in group) else None
    return RequestOutput(last.request_id, last.index, [t for d in group for t in d.new_token_ids], last.finished,
                         last.finish_reason, logprobs, last.num_prompt_tokens, last.num_cached_tokens, last.error,
                         last.queued_s)


def connect(address: str | None, min_cpus: float, timeout_s: float = 60.0) -> None:
    """Join the cluster at ``address`` (or $RAY_ADDRESS), else start a local Ray that can hold the engine. A head
    that does not answer within ``timeout_s`` is an error naming the address."""
    if ray.is_initialized():
        return
    if not starts_local_ray(address):
        check_head_answers(address or os.environ["RAY_ADDRESS"], timeout_s)
        ray.init(address=address)
        return
    # Ray starts its workers at nice 15, below its own daemons and every other process on the node. A rank's
    # torch threads are the engine's critical path: at nice 15 any nice-0 process (a load generator, a build)
    # takes their cores at once, and the other threads wait for the preempted one at the next barrier.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Logical CPUs only count reservations; the engine sets thread counts from the real cores.
    ray.init(num_cpus=max(os.cpu_count() or 1, int(min_cpus + 0.999)), include_dashboard=False)


def starts_local_ray(address: str | None) -> bool:
    """Whether `connect(address, ...)` starts a Ray of its own (no address given, none in $RAY_ADDRESS)."""
    return address is None and "RAY_ADDRESS" not in os.environ


def check_head_answers(address: str, timeout_s: float) -> None:
    """Raise RuntimeError unless the head's GCS at ``address`` (HOST:PORT) accepts a connection within
    ``timeout_s``: ray.init would retry an unreachable or wrong address silently for minutes. Other forms
    ("auto", ray://...) are left to Ray."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"no Ray head answers at {address} within placement_timeout_s={timeout_s:g} ({e}): check the "
                    f"address (`ray start --head` prints it; the port is 6379 unless --port says otherwise) and "
                    f"that this machine reaches that host and port") from None
            time.sleep(0.5)


def engine_bundles(config: EngineConfig, use_gpu: bool) -> list[dict[str, float]]:
    """Bundle 0 for the scheduler actor, bundle 1 + r for rank r."""
    rank = {"CPU": float(config.num_threads or 1)} | ({"GPU": 1.0} if use_gpu else {})
    return [{"CPU": SCHEDULER_CPUS}] + [dict(rank) for _ in range(config.tensor_parallel_size)]


def place(bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> PlacementGroup:
    """Reserve the bundles, or remove the request and raise RuntimeError naming what is missing."""
    pg = placement_group(bundles, strategy=strategy)
    if pg.wait(timeout_s):
        return pg
    remove_placement_group(pg)
    raise RuntimeError(placement_error(bundles, strategy, timeout_s))


def placement_error(bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> str:
    need: Counter[str] = Counter()
    for b in bundles:
        need.update(b)
    have, free = ray.cluster_resources(), ray.available_resources()
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    missing = {k: v - have.get(k, 0) for k, v in need.items() if v > have.get(k, 0)}
    msg = (f"cannot place the engine within placement_timeout_s={timeout_s:g}: its {len(bundles)} bundles "
           f"{bundles} ({strategy}) need {_show(need, need)} in all; the cluster has {_show(have, need)} "
           f"({_show(free, need)} free) on {nodes} node(s)")
    if missing:
        return msg + f"; missing: {_show(missing, missing)}"
    if strategy == "STRICT_SPREAD" and nodes < len(bundles):
        return msg + (f"; STRICT_SPREAD puts each bundle (the scheduler and every rank) on its own node: "
                      f"it needs {len(bundles)} nodes")
    return msg + "; the resources exist but not free, or not on one node as the strategy requires"


def lost_ranks(workers: list, ranks: list[NodeInfo], timeout_s: float = 5.0) -> str:
    """'; rank r on node IP (node id ...) is lost: why' for each rank whose actor is gone or does not answer
    within ``timeout_s``, else ''. Asked of the actors themselves: Ray marks a lost node dead only after its
    own health checks, seconds later, while a dead actor's call fails at once."""
    refs = [w.check_health.remote() for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    notes = []
    for r, (ref, info) in enumerate(zip(refs, ranks)):
        where = f"; rank {r} on node {info.ip} (node id {info.node_id}"
        if info.node_id not in alive:
            notes.append(f"{where}) is lost: Ray reports the node dead")
        elif ref not in ready:
            notes.append(f"{where}) does not answer within {timeout_s:g} s")
        else:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                notes.append(f"{where}) is lost: {type(e).__name__}")
    return "".join(notes)


def brief(reason: str) -> str:
    """A failure's first and last lines: a rank's error arrives with its whole traceback in between."""
    lines = [line for line in reason.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1].strip()}"


def _show(resources: dict[str, float], keys) -> str:
    return ", ".join(f"{k}: {resources.get(k, 0):g}" for k in sorted(keys))


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    return device


def bundle_device(pg: PlacementGroup, bundle: int) -> str:
    """The device a reserved rank bundle was sized for. Deciding again from the cluster could disagree with it
    (GPUs joining after the reservation) and leave a rank waiting for a GPU its bundle lacks."""
    return "cuda" if pg.bundle_specs[bundle].get("GPU") else "cpu"


def start_workers(config: EngineConfig, model_path: str, max_model_len: int, pg: PlacementGroup,
                  first_bundle: int, device: str) -> list:
    """Rank r goes to bundle ``first_bundle + 1 + r`` (``first_bundle`` is the scheduler's)."""
    wcfg = dataclasses.replace(config.worker_config(model_path, max_model_len), device=device)
    return [RayWorker.options(
        num_cpus=config.num_threads or 1, num_gpus=1 if device == "cuda" else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + 1 + r),
    ).remote(wcfg, r) for r in range(config.tensor_parallel_size)]


def init_workers(workers: list, num_threads: int | None, device: str,
                 timeout_s: float) -> tuple[int, int, list[NodeInfo]]:
    """Device, process group, model shard and KV cache on every rank; returns the blocks each rank holds (device,
    host tier) and where each rank runs. The ranks must form their process group within ``timeout_s``."""
    infos: list[NodeInfo] = ray.get([w.__ray_call__.remote(_node_info) for w in workers])
    ranks_per_node = Counter(i.node_id for i in infos)
    # Co-located ranks share their node's cores: oversubscribed torch threads stall at every barrier.
    threads = [num_threads or max(1, i.num_cores // ranks_per_node[i.node_id]) for i in infos]
    share_node_gpus(workers, [i.node_id for i in infos])
    ray.get([w.__ray_call__.remote(_init_device, n) for w, n in zip(workers, threads)])
    form_process_group(workers, infos, "nccl" if device == "cuda" else "gloo", timeout_s)
    ray.get([w.call.remote("load_model") for w in workers])
    num_blocks = min(ray.get([w.call.remote("determine_num_blocks") for w in workers]))
    if num_blocks < 2:
        block_bytes = ray.get(workers[0].call.remote("block_bytes"))
        raise ValueError(f"the KV cache holds {num_blocks} blocks of {block_bytes} bytes; raise kv_cache_bytes "
                         f"or gpu_memory_utilization")
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
    ifnames = ray.get([w.__ray_call__.remote(_socket_ifname, var, i.ifname if backend == "gloo" else None)
                       for w, i in zip(workers, infos)])
    master = infos[0]
    refs = [w.call.remote("init_distributed", rank, len(workers), master.ip, master.free_port, backend)
            for rank, w in enumerate(workers)]
    try:
        ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayTaskError) as e:
        why = (f"not within placement_timeout_s={timeout_s:g}" if isinstance(e, ray.exceptions.GetTimeoutError)
               else str(e.cause).strip().splitlines()[-1][-300:])
        ranks = "; ".join(f"rank {r} on node {i.ip}, {var}={n or 'unset'}"
                          for r, (i, n) in enumerate(zip(infos, ifnames)))
        raise RuntimeError(
            f"the {len(workers)} ranks did not form their {backend} process group at tcp://{master.ip}:"
            f"{master.free_port} ({ranks}): {why}. Each rank listens on the interface {var} names, so every node "
            f"must reach the others there. Set {var} to the interface that holds each node's Ray IP, in the "
            f"environment `ray start` runs in (docs/multinode.md), and let that traffic through the nodes' "
            f"firewalls") from None


def _release(pg: PlacementGroup | None, actors: list) -> None:
    """Kill the engine's actors and free its own placement group (run once, through weakref.finalize)."""
    if not ray.is_initialized():
        return
    for actor in actors:
        ray.kill(actor)
    if pg is not None:
        remove_placement_group(pg)


class RayEngine:
    """One engine on a Ray cluster: a placement group, the scheduler actor, one worker actor per rank.

    Invariants: once __init__ returns, every rank holds its model shard and a KV
    cache of the same ``num_blocks`` and the scheduler loop runs; if __init__
    fails it leaves no actor or placement group behind, and shutdown() (or
    garbage collection) releases them. Given a ``placement_group`` (a Serve
    replica's, which Serve reserved with engine_bundles at ``first_bundle``), the
    engine places itself there and leaves the group to its owner. ``_unfinished`` maps each caller id added
    through add_request to its samples still running, so step() knows without a
    round trip whether there is anything to wait for.
    """

    def __init__(self, config: EngineConfig, address: str | None = None, *,
                 placement_group: PlacementGroup | None = None, first_bundle: int = 0) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        self.model_path = config.resolved_model()
        self.spec = read_model_spec(self.model_path, tp)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        connect(address, SCHEDULER_CPUS + tp * (config.num_threads or 1), config.placement_timeout_s)
        self.device = (bundle_device(placement_group, first_bundle + 1)
                       if placement_group is not None and config.device == "auto" else resolve_device(config.device))
        pg = placement_group or place(engine_bundles(config, self.device == "cuda"), config.placement_strategy,
                                      config.placement_timeout_s)
        self.placement_group = pg
        owned: list = []
        self._finalizer = weakref.finalize(self, _release, None if placement_group else pg, owned)
        self._unfinished: dict[str, int] = {}
        self._queues: dict[str, asyncio.Queue] = {}  # generate's callers, by request id
        self._pump: asyncio.Task | None = None
        self._channel = f"async-{os.getpid()}-{id(self)}"
        self._received = {"sync": 0, self._channel: 0}  # the last batch number each channel got (get_outputs)
        try:
            self.workers = start_workers(config, self.model_path, self.max_model_len, pg, first_bundle, self.device)
            owned.extend(self.workers)
            self.actor = RaySchedulerActor.options(
                num_cpus=SCHEDULER_CPUS,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle),
            ).remote(self.workers, self.spec.eos_token_id)
            owned.append(self.actor)
            self.num_blocks, num_host_blocks, self.rank_nodes = init_workers(
                self.workers, config.num_threads, self.device, config.placement_timeout_s)
            swap_cost = ray.get(self.workers[0].call.remote("swap_cost_per_block"))
            ray.get(self.actor.start.remote(config.scheduler_config(self.num_blocks, self.max_model_len,
                                                                    num_host_blocks, swap_cost),
                                            config.step_timeout_s, config.async_scheduling))
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group; in-flight requests end with an actor error."""
        self._finalizer()

    def _vet(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        check_prompt(prompt_token_ids, self.spec.vocab_size, self.max_model_len)
        check_params(params, self.spec.vocab_size)
        return stop_token_ids(params, self.spec)

    # ---- synchronous interface (InProcessEngine's) --------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> list[RequestOutput]:
        params = self._vet(prompt_token_ids, params)
        finals = ray.get(self.actor.add_request.remote(request_id, list(prompt_token_ids), params, priority,
                                                       "sync", cache_salt))
        if len(finals) < params.n:
            self._unfinished[request_id] = params.n - len(finals)
        return finals

    def step(self) -> list[RequestOutput]:
        """The deltas of add_request's requests that arrived since the last call (waits for at least one)."""
        if not self._unfinished:
            return []
        self._received["sync"], outputs = ray.get(self.actor.get_outputs.remote("sync", self._received["sync"]))
        for out in outputs:
            if out.finished and out.request_id in self._unfinished:
                self._unfinished[out.request_id] -= 1
                if not self._unfinished[out.request_id]:
                    del self._unfinished[out.request_id]
        return outputs

    def abort(self, request_id: str) -> list[RequestOutput]:
        self._unfinished.pop(request_id, None)
        return ray.get(self.actor.abort.remote(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def stats(self) -> SchedulerStats:
        return ray.get(self.actor.stats.remote())

    def routing_digest(self, limit: int) -> tuple[list[bytes], int]:
        return ray.get(self.actor.routing_digest.remote(limit))

    def request_steps(self, request_ids: list[str]) -> dict[str, RequestSteps]:
        return ray.get(self.actor.request_steps.remote(request_ids))

    def check_health(self) -> None:
        """Raise RuntimeError saying why when the engine cannot serve, naming the ranks lost and their nodes."""
        try:
            ray.get(self.actor.check_health.remote())
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"the scheduler actor is gone: {brief(str(e))}"
                               f"{lost_ranks(self.workers, self.rank_nodes)}") from None
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"{brief(str(e.cause))}{lost_ranks(self.workers, self.rank_nodes)}") from None

    # ---- async interface (the Serve app's) ---------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's deltas as they come; leaving the loop early (or being cancelled) aborts it.

        Every generate of this engine shares one channel: a single pump fetches each step's deltas for all
        of them in one call and hands them out, where a Ray stream per request would cost one object per
        request per step (a fifth of a core at 64 requests on 2 cores, taken from the ranks)."""
        params = self._vet(prompt_token_ids, params)
        if request_id in self._queues:  # checked here: its queue would take the running caller's deltas
            raise ValueError(f"request_id={request_id!r} is invalid: a request with this id is still running")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        remaining = params.n
        try:
            self._ensure_pump()
            finals = await self.actor.add_request.remote(request_id, list(prompt_token_ids), params, priority,
                                                        self._channel, cache_salt)
            for out in finals:
                remaining -= 1
                yield out
            while remaining:
                deltas = [await queue.get()]
                while not queue.empty():
                    deltas.append(queue.get_nowait())
                for item in deltas:
                    if isinstance(item, BaseException):
                        raise item
                for out in merge_deltas(deltas):
                    remaining -= out.finished
                    yield out
        finally:
            self._queues.pop(request_id, None)
            if remaining:
                self.actor.abort.remote(request_id)

    def end_callers(self, error: BaseException) -> int:
        """End every ``generate`` still running by raising ``error`` in it, each aborting its request in the
        engine (and so freeing its KV blocks) as it leaves; returns how many were running."""
        for queue in self._queues.values():
            queue.put_nowait(error)
        return len(self._queues)

    def _ensure_pump(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pump is None or self._pump.done() or self._pump.get_loop() is not loop:
            self._pump = loop.create_task(self._pump_outputs())

    async def _pump_outputs(self) -> None:
        """Hand each batch of the channel's deltas to the callers' queues, for as long as the loop lives; on
        failure every waiting caller gets the exception. Cancelled (its loop closing), it cancels the call it
        waits on in the actor; should that call still return a batch, the next pump's acknowledgement
        (``received``) gets the batch sent again."""
        while True:
            ref = self.actor.get_outputs.remote(self._channel, self._received[self._channel])
            try:
                self._received[self._channel], outputs = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except Exception as e:  # the actor died or the engine failed: nobody's deltas will come
                self.end_callers(e)
                return
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
