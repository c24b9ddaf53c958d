"""Drivers the multi-host tests run inside a test host, as ``python -m tests.cluster.hosts_driver FUNC HEAD_IP
ARGS...``: each joins the hosts' Ray cluster at HEAD_IP from there (a driver must sit on a Ray node, and pytest's
own process already has the session's local Ray), does one thing, and prints one JSON line for the test."""

from __future__ import annotations

import json
import os
import sys
import time

import ray

from cluster.ray_engine import RayEngine
from tests.cluster.test_ray_engine import config, run_to_completion


def _where(_actor) -> str:
    return ray.util.get_node_ip_address()


def _gloo_ifname(_actor) -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


def tp2(head_ip: str, model: str) -> dict:
    """Greedy outputs of a tp=2 STRICT_SPREAD engine, where its actors ran and how its ranks met."""
    engine = RayEngine(config(model, tensor_parallel_size=2, num_threads=2, placement_strategy="STRICT_SPREAD"),
                       address=f"{head_ip}:6379")
    try:
        return {"ips": ray.get([a.__ray_call__.remote(_where) for a in [engine.actor, *engine.workers]]),
                "strategy": ray.util.placement_group_table(engine.placement_group)["strategy"],
                "master": engine.rank_nodes[0].ip,
                "ifnames": ray.get([w.__ray_call__.remote(_gloo_ifname) for w in engine.workers]),
                "outputs": run_to_completion(engine)}
    finally:
        engine.shutdown()


def tp2_with_ifname(head_ip: str, model: str, ifname: str, timeout_s: str) -> dict:
    """A tp=2 engine whose job sets GLOO_SOCKET_IFNAME=``ifname`` for every actor: its error and how long it took,
    and the states of the placement groups left."""
    ray.init(address=f"{head_ip}:6379", runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": ifname}},
             log_to_driver=False)
    start = time.monotonic()
    try:
        RayEngine(config(model, tensor_parallel_size=2, num_threads=2, placement_strategy="STRICT_SPREAD",
                         placement_timeout_s=float(timeout_s)))
    except RuntimeError as e:
        return {"error": str(e), "elapsed_s": time.monotonic() - start,
                "groups": [g["state"] for g in ray.util.placement_group_table().values()]}
    return {"error": None}


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]](*sys.argv[2:])), flush=True)
