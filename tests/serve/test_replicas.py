"""Two replicas behind HAProxy and the prefix-cache router (the default model, one live deployment): requests
follow their cached prefix, one scrape covers both replicas, what the router cannot hash gets the replica's
400, and a replica that dies leaves routing."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import ray
from ray import serve

from engine.config import EngineConfig
from engine.network import free_port
from serve import APP_NAME, AppArgs
from tests.serve.test_server import STALE_S, WAIT_S, metrics, serving, wait_metrics

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are the support assistant of a bicycle shop. Answer briefly and politely. " * 12
BLOCK = 16


def running_replicas() -> int:
    return serve.status().applications[APP_NAME].deployments["LLMServer"].replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def url(default_model_dir):
    args = AppArgs(
        engine=EngineConfig(
            model=default_model_dir, max_model_len=1024, max_num_seqs=8, kv_cache_bytes=96 << 20, block_size=BLOCK
        ),
        served_model_name=MODEL,
        min_replicas=2,
        max_replicas=2,
    )
    with serving(args, port=free_port(), grpc_port=free_port()) as url:
        deadline = time.monotonic() + 300
        while running_replicas() < 2:
            assert time.monotonic() < deadline, "the second replica did not start"
            time.sleep(0.5)
        time.sleep(STALE_S)  # HAProxy reloads its config with the second replica
        yield url


def chat(url: str, question: str, system: str = SYSTEM) -> httpx.Response:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_requests_follow_their_cached_prefix(url):
    first = chat(url, "Do you sell helmets?")
    assert first.status_code == 200, first.text
    shared_blocks = first.json()["usage"]["prompt_tokens"] // BLOCK - 2  # the system prompt's, at least
    time.sleep(STALE_S)  # the replica's digest now holds them
    for question in [
        "Are you open on Sunday?",
        "How much is a chain?",
        "Can I rent a tandem?",
        "Do you fix flat tyres?",
        "Where are you?",
        "Do you ship abroad?",
    ]:
        usage = chat(url, question).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= shared_blocks * BLOCK, (question, usage)


def test_one_scrape_covers_both_replicas_and_counters_never_go_back(url):
    prompts = [f"Tenant {i} says: " + "lorem ipsum dolor sit amet " * (10 + i) for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once, so load spreads them over both replicas
        codes = list(
            pool.map(
                lambda p: (
                    httpx.post(
                        f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 8}, timeout=120
                    ).status_code
                ),
                prompts,
            )
        )
    assert codes == [200] * len(prompts)

    wait_metrics(url, lambda m: len(served_by_replica(url)) >= 2)
    last: dict[str, float] = {}
    for _ in range(5):
        now = {k: v for k, v in metrics(url, by_replica=True).items() if "_total{" in k}
        assert all(now.get(k, 0) >= v for k, v in last.items()), "a counter went backwards"
        last = now
        time.sleep(0.5)


def served_by_replica(url: str) -> dict[str, float]:
    """Finished requests per replica label, from one scrape."""
    out: dict[str, float] = {}
    for key, value in metrics(url, by_replica=True).items():
        if key.startswith("vllm:request_success_total{"):
            replica = key.split("replica=")[1].split(",")[0].rstrip("}")
            out[replica] = out.get(replica, 0) + value
    return out


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b'{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "bogus": 1}', "unsupported_field"),
        (b'{"model": "SmolLM2-135M-Instruct", "prompt": "' + b"word " * 1500 + b'"}', "context_length_exceeded"),
    ],
    ids=["not-json", "unknown-field", "too-long"],
)
def test_what_the_router_cannot_hash_gets_the_replicas_400(url, body, code):
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


def test_a_dead_replica_leaves_routing(url):
    """Kill a replica: requests are served again, ten in a row (by the other, or the one Serve starts in its
    place), with none lost to the dead one once they are."""
    replicas = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#LLMServer#")
    ]
    assert len(replicas) == 2
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    bound_s = 10.0 + WAIT_S  # Serve's default health-check period, which the deployment keeps, and a margin
    deadline, in_a_row = time.monotonic() + bound_s, 0
    while in_a_row < 10:
        assert time.monotonic() < deadline, f"requests still failed {bound_s:g} s after the kill"
        try:
            ok = chat(url, "Is the dead replica gone?").status_code == 200
        except httpx.HTTPError:  # the request was on its way to the replica that died
            ok = False
        in_a_row = in_a_row + 1 if ok else 0
        time.sleep(0.2)
