"""Drivers the multi-host tests run inside a test host, as ``python -m tests.hosts_driver FUNC HEAD_IP
ARGS...``: each joins the hosts' Ray cluster at HEAD_IP from there (a driver must sit on a Ray node, and pytest's
own process already has the session's local Ray), does one thing, and prints one JSON line for the test."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request

import aiohttp
import ray

from engine.config import EngineConfig
from engine.ray_client import RayEngine
from scheduler import EngineRequest
from serve import AppArgs, start
from tests.engine.test_kv_transfer_ray import disaggregated
from tests.engine.test_ray_engine import PROMPTS, config, greedy, run_to_completion
from tests.serve.test_server import stop_serve


def _where(_actor) -> str:
    return ray.util.get_node_ip_address()


def _gloo_ifname(_actor) -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


def tp2(head_ip: str, model: str) -> dict:
    """Greedy outputs of a tp=2 STRICT_SPREAD engine, where its actors ran and how its ranks met."""
    engine = RayEngine(
        config(model, tensor_parallel_size=2, num_threads=2, placement_strategy="STRICT_SPREAD"),
        address=f"{head_ip}:6379",
    )
    try:
        return {
            "ips": ray.get([a.__ray_call__.remote(_where) for a in [engine.actor, *engine.workers]]),
            "strategy": ray.util.placement_group_table(engine.placement_group)["strategy"],
            "master": engine.rank_nodes[0].ip,
            "ifnames": ray.get([w.__ray_call__.remote(_gloo_ifname) for w in engine.workers]),
            "outputs": run_to_completion(engine),
        }
    finally:
        engine.shutdown()


def ep2(head_ip: str, model: str) -> dict:
    """Greedy outputs of a tp=2 expert-parallel STRICT_SPREAD engine (each rank holds half the experts, and
    every MoE layer's tokens cross hosts), and where its actors ran."""
    engine = RayEngine(
        config(
            model,
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            num_threads=2,
            placement_strategy="STRICT_SPREAD",
        ),
        address=f"{head_ip}:6379",
    )
    try:
        return {
            "ips": ray.get([a.__ray_call__.remote(_where) for a in [engine.actor, *engine.workers]]),
            "outputs": run_to_completion(engine),
        }
    finally:
        engine.shutdown()


def pd(head_ip: str, model: str) -> dict:
    """Two one-rank engines, each filling a worker host (PACK): every prompt computed by the first and decoded by
    the second, twice (the second time the decode engine holds the prompts' prefixes). The greedy outputs, where
    each engine's rank ran, and the KV bytes the decode rank fetched."""
    prefill = RayEngine(config(model, num_threads=1), address=f"{head_ip}:6379")
    decode = RayEngine(config(model, num_threads=1))

    async def run() -> list[list[int]]:
        requests = [
            EngineRequest(request_id=f"{r}-{i}", prompt_token_ids=p, sampling_params=greedy(12))
            for r in range(2)
            for i, p in enumerate(PROMPTS)
        ]
        return [await disaggregated(prefill, decode, request) for request in requests]

    try:
        return {
            "ips": ray.get([e.workers[0].__ray_call__.remote(_where) for e in (prefill, decode)]),
            "outputs": asyncio.run(run()),
            "kv_bytes": decode.stats().kv_transfer_bytes,
        }
    finally:
        prefill.shutdown()
        decode.shutdown()


def tp2_with_ifname(head_ip: str, model: str, ifname: str, timeout_s: str) -> dict:
    """A tp=2 engine whose job sets GLOO_SOCKET_IFNAME=``ifname`` for every actor: its error and how long it took,
    and the states of the placement groups left."""
    ray.init(address=f"{head_ip}:6379", runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": ifname}}, log_to_driver=False)
    start = time.monotonic()
    try:
        RayEngine(
            config(
                model,
                tensor_parallel_size=2,
                num_threads=2,
                placement_strategy="STRICT_SPREAD",
                placement_timeout_s=float(timeout_s),
            )
        )
    except RuntimeError as e:
        return {
            "error": str(e),
            "elapsed_s": time.monotonic() - start,
            "groups": [g["state"] for g in ray.util.placement_group_table().values()],
        }
    return {"error": None}


# ---- a host lost under Serve ------------------------------------------------------------------------

STREAMS = 3
ERROR_BOUND_S = 60.0  # kill to the last in-flight stream's error event: a generous wait, not a target
SERVING_BOUND_S = 240.0  # kill to a completion answered by the replica Serve builds in its place


def _group_hosts(hosts: dict[str, str]) -> list[str]:
    """The namespaces of the hosts holding the live replica's bundles: replica, scheduler, rank 0, rank 1."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    (group,) = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    return [hosts[ips[group["bundles_to_node_id"][b]]] for b in range(4)]


async def _stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event) -> tuple[float, str]:
    """Stream a long completion; once its first text has come, set ``started``. Returns when the stream ends
    and what its last event said."""
    body = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    last = ""
    async with session.post(f"{url}/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                last = line.decode()
                started.set()
    return time.monotonic(), last


def _get(url: str, data: dict | None = None, timeout_s: float = 30) -> tuple[int, str]:
    req = urllib.request.Request(
        url, data=json.dumps(data).encode() if data else None, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


async def _kill_mid_generation(url: str, victim: str) -> tuple[float, list[tuple[float, str]]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ERROR_BOUND_S + 60)) as session:
        started = [asyncio.Event() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(_stream(session, url, e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        pids = subprocess.run(["ip", "netns", "pids", victim], capture_output=True, text=True).stdout.split()
        subprocess.run(["kill", "-9", *pids])
        killed = time.monotonic()
        return killed, await asyncio.wait_for(asyncio.gather(*tasks), ERROR_BOUND_S + 30)


def serve_pp2(head_ip: str, model: str, hosts_json: str, prompt_json: str) -> dict:
    """Serve pp=2 across hosts: one greedy completion of the token ids ``prompt_json``, and the hosts of the
    replica's bundles; Serve is stopped after, so the module's next driver can start its own."""
    hosts = json.loads(hosts_json)
    args = AppArgs(
        engine=EngineConfig(model=model, pipeline_parallel_size=2, num_threads=2, block_size=8, kv_cache_bytes=1 << 22)
    )
    url = start(args, address=f"{head_ip}:6379", host="0.0.0.0", port=8000, timeout_s=180)
    try:
        body = {"prompt": json.loads(prompt_json), "max_tokens": 12, "temperature": 0.0}
        # the first step of a fresh engine on a loaded machine may take longer than a health poll's 30 s
        return {"completion": _get(f"{url}/v1/completions", body, timeout_s=150), "hosts": _group_hosts(hosts)}
    finally:
        stop_serve()


def lost_host(head_ip: str, model: str, hosts_json: str) -> dict:
    """Serve tp=2 across hosts, kill a rank's host while streams run; report how the streams ended and
    when, what /health said, and when a completion was answered again and by which hosts' ranks."""
    hosts = json.loads(hosts_json)  # ip -> namespace
    args = AppArgs(
        engine=EngineConfig(model=model, tensor_parallel_size=2, num_threads=2, block_size=8, kv_cache_bytes=1 << 22),
        # Serve replaces the replica after three failed checks: at the default period (10 s), half the time
        # the test takes.
        health_check_period_s=2.0,
    )
    url = start(args, address=f"{head_ip}:6379", host="0.0.0.0", port=8000, timeout_s=180)
    before = _group_hosts(hosts)
    # PACK decides where the bundles go: lose a rank's host that holds neither the head (this driver, the GCS)
    # nor the replica or the scheduler.
    rank = next(r for r in (1, 0) if before[2 + r] not in (hosts[head_ip], *before[:2]))
    victim = before[2 + rank]
    killed, ends = asyncio.run(_kill_mid_generation(url, victim))
    health = (0, "")
    while health[0] != 503 and time.monotonic() - killed < ERROR_BOUND_S:
        health = _get(f"{url}/health")
    serving = None
    while time.monotonic() - killed < SERVING_BOUND_S:
        status, _ = _get(f"{url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
        if status == 200:
            serving = time.monotonic() - killed
            break
        time.sleep(1)
    return {
        "victim": victim,
        "rank": rank,
        "error_after_s": [t - killed for t, _ in ends],
        "last_events": [e for _, e in ends],
        "health": health,
        "serving_after_s": serving,
        "ranks_after": _group_hosts(hosts)[2:] if serving else None,
    }


def several(head_ip: str, calls_json: str) -> dict:
    """Each ``[func, *args]`` of ``calls_json`` in turn in this one process (a driver's imports and its join cost
    seconds of CI each): func -> its result, or {"failed": the traceback} when it raised."""
    reports = {}
    for func, *args in json.loads(calls_json):
        try:
            reports[func] = globals()[func](head_ip, *args)
        except Exception:
            reports[func] = {"failed": traceback.format_exc()}
    return reports


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]](*sys.argv[2:])), flush=True)
