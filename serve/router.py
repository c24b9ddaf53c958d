"""Routing each request to the replica whose prefix cache holds the longest prefix of its tokens.

Where it sits. HTTP reaches replicas through HAProxy (``ingress.py``), which bypasses Serve's Python request
router, so a ``request_router_class`` alone would never see an HTTP request (Ray refuses one on a
HAProxy-fronted ingress deployment for that reason). The pinned Ray's extension point for that mode is an
*ingress request router*: a deployment attached with ``Application._with_ingress_request_router`` (the hook
Ray Serve LLM's direct streaming uses; Ray marks it internal) that serves ``POST /internal/route``. HAProxy's
Lua action posts each POST request's body there (``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1``), and
``RouteServer`` asks the LLMServer deployment's handle ``choose_replica(..., _reserve=False)``, which runs
``PrefixCacheRouter`` (the deployment's ``request_router_class``) and answers the replica's id; HAProxy then
sends the request, and its whole SSE stream, straight to that replica as before. The per-token path is
unchanged; each request pays one loopback HTTP exchange between HAProxy and the router, in which the router
parses and tokenizes the body (the chat template included) and hashes its full blocks. Measured (2-core CPU
node, two replicas, 40 calls each, median / p90): 0.8 / 1.3 ms for a body of 544 token ids, 1.7 / 3.0 ms for
a ~550-token chat; the replica tokenizes the prompt again (the router does not hand it the ids). GET requests and
gRPC (through Serve's gRPC proxy, which calls the same request router) carry no hashes and are balanced by
load. With one replica there is nothing to choose and no router is attached.

What replicas publish. Each replica's ``record_routing_stats`` (polled by Serve's controller every
``options.ROUTING_STATS_PERIOD_S`` and pushed to every handle) returns a digest: the hashes of up to
``DIGEST_BLOCKS`` blocks its scheduler's prefix cache holds (most recently cached first; the same chained
xxh3 hashes the scheduler computes, a body's ``cache_salt`` hashed into its first block as the scheduler
does, so salted requests meet only their own salt's blocks, and a LoRA adapter's requests only its own), and
the number of requests its scheduler holds. So the digest is exact but up to one period plus the controller's
push old. To cover that gap the router also remembers, per replica, the block hashes of the requests it routed
there in the last ``RECENT_S`` seconds of the digest's time, and counts the requests it routed after the digest
as load.

The choice, per request. Its hit on a replica is the number of its leading block hashes the replica's digest
or recent routes hold. Among the replicas with the longest hit, the least loaded (load: the digest's requests
plus this router's later routes) is the pick, unless it is overloaded *for this request*: its load exceeds
``OVERLOAD_FACTOR`` times the least-loaded replica's plus half a replica's ``max_ongoing_requests`` (its
batch, ``max_num_seqs``, by default), i.e. the request would queue behind a multiple of the work it would find
elsewhere, and more than half a batch of it. The slack matters because the load is an over-estimate between
digests: it counts every request routed since the last one, finished or not. With no hit of at least one
block, or an overloaded pick, the request goes to the less loaded of two replicas drawn at random (power of
two). A body the router cannot hash (not JSON, a field the replica refuses, a chat template that fails, a body
HAProxy truncated) is routed by load, and the replica answers it with its normal 400. A replica that dies
leaves Serve's replica set when its health check fails, and its digest and recent routes go with it.
"""

# No `from __future__ import annotations`: FastAPI reads the route's annotations (Request) through Serve's
# wrappers, whose globals are not this module's (as in server.py).

import json
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from engine.client import EngineClient, prompt_block_hashes
from engine.model_files import load_tokenizer
from scheduler import EngineRequest
from serve.options import AppArgs
from serve.prompts import body_prompt_ids

HASHES_KWARG = "block_hashes"
DIGEST_BLOCKS = 16384  # 256 KiB of hashes per replica per period: the prefixes of a few thousand requests
RECENT_S = 10.0  # a long prompt's prefill may finish (and its blocks enter the digest) seconds after routing
OVERLOAD_FACTOR = 2.0
MIN_HIT_BLOCKS = 1


async def replica_routing_stats(engine: EngineClient) -> dict[str, Any]:
    """What one replica publishes (``LLMServer.record_routing_stats``)."""
    hashes, num_requests = await engine.routing_digest(DIGEST_BLOCKS)
    return {"block_hashes": frozenset(hashes), "num_requests": num_requests, "time": time.time()}


def request_block_hashes(tokenizer: Any, body: bytes, block_size: int, base_model: str | None = None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the scheduler computes them (a ``model`` other than
    `base_model` names a LoRA adapter, hashed in as the scheduler does); [] for a body that the replica would
    refuse (it answers that with a 400, not the router)."""
    try:
        data = json.loads(body)
        ids = body_prompt_ids(tokenizer, data)
        model = data.get("model")
        lora_name = model if base_model is not None and model not in (None, base_model) else None
        request = EngineRequest(
            request_id="route", prompt_token_ids=ids, cache_salt=data.get("cache_salt"), lora_name=lora_name
        )
        return prompt_block_hashes(request, block_size)
    except Exception:  # anything the body's validation, its template or its ids raise: the replica says what
        return []


def choose(hits: list[int], loads: list[int], slack: float, rng: random.Random) -> int:
    """The index of the replica a request goes to, from its hit (blocks) and load on each (module doc)."""
    best_hit = max(hits)
    if best_hit >= MIN_HIT_BLOCKS:
        pick = min((i for i, h in enumerate(hits) if h == best_hit), key=lambda i: loads[i])
        if loads[pick] <= OVERLOAD_FACTOR * min(loads) + slack:
            return pick
    a, b = rng.sample(range(len(hits)), 2) if len(hits) > 1 else (0, 0)
    return a if loads[a] <= loads[b] else b


@dataclass(slots=True)
class RecentRoutes:
    """The requests this router sent one replica lately: (time, block hashes) oldest first, and how many of
    them hold each hash. Invariant: ``counts`` counts exactly the hashes of ``routes``."""

    routes: deque[tuple[float, list[bytes]]] = field(default_factory=deque)
    counts: Counter[bytes] = field(default_factory=Counter)

    def add(self, t: float, hashes: list[bytes]) -> None:
        self.routes.append((t, hashes))
        self.counts.update(hashes)

    def forget_before(self, t: float) -> None:
        while self.routes and self.routes[0][0] < t:
            self.counts.subtract(self.routes.popleft()[1])
        if not self.routes:
            self.counts.clear()

    def num_after(self, t: float) -> int:
        return sum(1 for rt, _ in reversed(self.routes) if rt > t) if self.routes and self.routes[-1][0] > t else 0


class PrefixCacheRouter(FIFOMixin, RequestRouter):
    """Serve request router of the LLMServer deployment: longest exact prefix-cache hit, bounded by load
    (module doc). State: per replica, what this router routed there recently; replicas that leave the
    deployment leave it too."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.recent: dict[Any, RecentRoutes] = {}
        self.rng = random.Random()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for replica_id in [k for k in self.recent if k not in live]:
            del self.recent[replica_id]

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.recent.pop(replica_id, None)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = pending_request.kwargs.get(HASHES_KWARG) or [] if pending_request is not None else []
        now = time.time()
        hits, loads = [], []
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            published = stats.get("time", 0.0)
            recent = self.recent.setdefault(r.replica_id, RecentRoutes())
            recent.forget_before(published - RECENT_S)
            hits.append(_hit(hashes, stats.get("block_hashes", frozenset()), recent.counts))
            loads.append(stats.get("num_requests", 0) + recent.num_after(published))
        slack = candidate_replicas[0].max_ongoing_requests / 2
        chosen = candidate_replicas[choose(hits, loads, slack, self.rng)]
        self.recent[chosen.replica_id].add(now, hashes)
        return [[chosen]]


def _hit(hashes: list[bytes], digest: frozenset[bytes], recent: Counter[bytes]) -> int:
    n = 0
    for h in hashes:
        if h not in digest and recent[h] <= 0:
            break
        n += 1
    return n


route_app = FastAPI()


@serve.deployment(name="PrefixCacheRoute", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(route_app)
class RouteServer:
    """Serves HAProxy's ``POST /internal/route``: the body's block hashes in, a replica of the LLMServer
    deployment out (``{"host", "port", "replica_id"}``). It always answers 200 while a replica is up: what
    it cannot hash is routed by load, so that the replica gives the client its 400."""

    def __init__(self, server: DeploymentHandle, args: AppArgs) -> None:
        self.server = server
        self.tokenizer = load_tokenizer(args.engine, args.engine.resolved_model())
        self.block_size = args.engine.block_size
        self.model_name = args.model_name
        self.server._init()

    @route_app.post("/internal/route")
    async def route(self, request: Request) -> dict[str, Any]:
        body = await request.body()
        hashes = (
            []
            if "x-body-truncated" in request.headers
            else request_block_hashes(self.tokenizer, body, self.block_size, self.model_name)
        )
        kwargs: dict[str, Any] = {"_reserve": False}
        if hashes:
            kwargs[HASHES_KWARG] = hashes
        async with self.server.choose_replica(**kwargs) as selection:
            replica = selection._replica  # Serve's own LLMRouter reads the pick the same way
            host, port = replica.backend_http_endpoint
            return {"host": host, "port": port, "replica_id": replica.replica_id.to_full_id_str()}
