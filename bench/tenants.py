"""`raylm bench serve --dataset multi-tenant --compare routers`: G tenants, each with a long shared prefix
(a system prompt, earlier turns), their requests arriving interleaved, on two replicas: once with the
prefix-cache router, once with Serve's own balancing, in one invocation. Per run: the prefix-cache hit rate
summed over replicas, TTFT, and each replica's share of the requests.

The KV cache of a replica is sized to hold about half the tenants' prefixes, the case routing is for: a
deployment whose tenants no longer fit one engine's cache. Spread by load, every replica sees every tenant
and evicts what it will need next; routed by cache, each holds its half.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.serve import Workload, run_workload
from bench.servers import raylm_server
from engine.network import free_port

METRICS_LAG_S = 3.0  # the servers export metrics each second (below): a scrape this long after is current


def multi_tenant_workload(
    groups: int,
    per_group: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int,
    request_rate: float,
    seed: int = 0,
) -> Workload:
    """``groups`` prefixes of ``prefix_len`` random token ids; each request one of them plus its own
    ``suffix_len`` tokens; rounds of one request per group, in a shuffled order each round."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab_size) for _ in range(prefix_len)] for _ in range(groups)]
    requests = []
    for _ in range(per_group):
        for g in rng.sample(range(groups), groups):
            requests.append((prefixes[g] + [rng.randrange(100, vocab_size) for _ in range(suffix_len)], output_len))
    rate = "all at once" if request_rate == float("inf") else f"Poisson {request_rate:g} req/s"
    return Workload(
        requests,
        request_rate,
        f"{groups} tenants x {per_group} requests, {prefix_len}-token shared "
        f"prefix + {suffix_len} own tokens, {output_len} out, interleaved, {rate}",
    )


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(series name, replica) -> value, for the counters this benchmark reads."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=120) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total",
                "vllm:request_success_total",
                "vllm:num_requests_running",
            ):
                key = (s.name, s.labels.get("replica", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def wait_replicas(url: str, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if len({r for name, r in scrape(url) if name == "vllm:num_requests_running"}) >= n:
                return
        except OSError:  # a replica still loading its model can be slow to answer on a small machine
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not show {n} replicas in /metrics within {timeout_s:g} s")
        time.sleep(1)


def run_router(
    router: str, model_args: list[str], work: Workload, kv_cache_bytes: int, max_num_seqs: int, seed: int
) -> dict:
    args = [
        *model_args,
        "--min-replicas",
        "2",
        "--max-replicas",
        "2",
        "--request-router",
        router,
        "--num-threads",
        "1",
        "--kv-cache-bytes",
        str(kv_cache_bytes),
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    with raylm_server(free_port(), args, env={"RAY_metrics_report_interval_ms": "1000"}) as server:
        wait_replicas(server.url, 2)
        time.sleep(METRICS_LAG_S)
        before = scrape(server.url)
        row = run_workload(f"router={router}", server.url, work, seed=seed)
        time.sleep(METRICS_LAG_S)
        after = scrape(server.url)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    total = {name: sum(v for (n, _), v in delta.items() if n == name) for name, _ in delta}
    row["hit_rate"] = total["vllm:prefix_cache_hits_total"] / max(total["vllm:prefix_cache_queries_total"], 1)
    served = {r: v for (n, r), v in delta.items() if n == "vllm:request_success_total"}
    # the warm-up request is one of them; the fair share is the total over the replicas
    row["max_share"] = max(served.values()) / (sum(served.values()) / 2)
    print(
        f"    prefix-cache hit rate (tokens, both replicas) {row['hit_rate']:.3f}; requests per replica "
        f"{sorted(int(v) for v in served.values())}, the busiest {row['max_share']:.2f}x its fair share"
    )
    return row


def kv_bytes_per_token(model_path: str) -> int:
    """The KV cache's bytes per token in fp32 (the CPU dtype): keys and values of every layer's KV heads."""
    c = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4


def compare_routers(
    model: str | None, model_path: str, work: Workload, groups: int, max_num_seqs: int, seed: int
) -> dict:
    """Both routers on the same workload; prints each row, then the cache-aware one's ratios."""
    # a replica's cache holds the sequences of about half the tenants plus one: its half when routed by cache
    seq_len = max(len(p) + n for p, n in work.requests)
    kv_cache_bytes = (groups // 2 + 1) * seq_len * kv_bytes_per_token(model_path)
    print(
        f"  each replica: a {kv_cache_bytes >> 20} MiB KV cache (about {groups // 2 + 1} of the {groups} tenants' "
        f"sequences), one thread, max {max_num_seqs} sequences"
    )
    model_args = ["--model", model] if model else []
    rows = {r: run_router(r, model_args, work, kv_cache_bytes, max_num_seqs, seed) for r in ("prefix_cache", "serve")}
    ours, theirs = rows["prefix_cache"], rows["serve"]
    print(
        f"  prefix_cache / serve: hit rate {ours['hit_rate'] / max(theirs['hit_rate'], 1e-9):.2f}x, "
        f"TTFT median {ours['ttft']['median'] / theirs['ttft']['median']:.2f}x, "
        f"TTFT mean {ours['ttft']['mean'] / theirs['ttft']['mean']:.2f}x, "
        f"output tok/s {ours['output_throughput'] / theirs['output_throughput']:.2f}x; busiest replica "
        f"{ours['max_share']:.2f}x vs {theirs['max_share']:.2f}x its fair share"
    )
    return rows
