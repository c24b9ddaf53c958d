"""Autoscaling shown to work: load starts a second replica, which serves, and the deployment scales back to
one when idle (Serve's delays tuned down so that the test stays bounded); bad replica bounds are refused."""

import threading
import time

import httpx2 as httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from ray import serve

from engine.config import EngineConfig
from engine.network import free_port
from serve import APP_NAME, AppArgs, deployment_options
from serve.metrics import render_node_metrics
from serve.server import LLMServer
from tests.serve.test_replicas import MODEL, running_replicas
from tests.serve.test_server import stop_serve

pytestmark = pytest.mark.usefixtures("ray_session")

MAX_NUM_SEQS = 2  # target_ongoing_requests = 1: two streams at once are twice the target
FAST = {"upscale_delay_s": 1.0, "downscale_delay_s": 5.0, "look_back_period_s": 2.0}
MAX_MODEL_LEN = 1024
STREAM_TOKENS = 512  # a stream of the tiny model lasts long enough to count as ongoing in each look-back window
SCALE_S = 240  # bound on a scale-up (a replica loads the model and builds its engine) or a scale-down


def test_min_replicas_above_max_is_refused():
    with pytest.raises(ValidationError, match="min_replicas=3 is greater than max_replicas=2"):
        AppArgs(min_replicas=3, max_replicas=2)


def test_scale_to_zero_is_refused_with_the_reason():
    with pytest.raises(ValidationError, match="min_replicas=0 is invalid.*Scale to zero is refused because"):
        AppArgs(min_replicas=0, max_replicas=2)


def served_by_replica() -> dict[str, float]:
    """Finished requests per replica, from Ray's metrics endpoint on this (the only) node."""
    text = render_node_metrics(ray.nodes()[0]["MetricsExportPort"])
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total":
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0) + s.value
    return out


def wait_replicas(n: int) -> None:
    deadline = time.monotonic() + SCALE_S
    while running_replicas() != n:
        if time.monotonic() > deadline:
            pytest.fail(f"the deployment did not reach {n} running replicas within {SCALE_S} s")
        time.sleep(0.5)


def test_load_starts_a_second_replica_that_serves_and_idle_scales_back(servable_tiny_model):
    # A tiny model: the replicas start, and share two cores with the load, in a fraction of the default model's time.
    args = AppArgs(
        engine=EngineConfig(
            model=servable_tiny_model(max_position_embeddings=MAX_MODEL_LEN),
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            kv_cache_bytes=16 << 20,
            num_threads=1,
        ),
        served_model_name=MODEL,
        min_replicas=1,
        max_replicas=2,
        request_router="serve",
    )
    options = deployment_options(args)
    options["autoscaling_config"] |= FAST
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:  # a failed start is stopped too: a Serve left running keeps its ports, and later starts are refused
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(LLMServer.options(**options).bind(args), name=APP_NAME, route_prefix="/")
        assert running_replicas() == 1
        stop = threading.Event()

        def stream_until_stopped() -> None:
            body = {
                "model": MODEL,
                "prompt": "Once upon a time",
                "max_tokens": STREAM_TOKENS,
                "ignore_eos": True,
                "stream": True,
            }
            while not stop.is_set():
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break

        load = [threading.Thread(target=stream_until_stopped) for _ in range(2 * MAX_NUM_SEQS)]
        for t in load:
            t.start()
        try:
            wait_replicas(2)
            # the new replica serves: the streams (one after another on each thread) finish on both. Read from
            # Ray's metrics endpoint, as Prometheus does: /metrics itself waits behind the replicas' full batches.
            deadline = time.monotonic() + SCALE_S
            while len(served_by_replica()) < 2:
                assert time.monotonic() < deadline, "the second replica finished no request"
                time.sleep(1)
        finally:
            stop.set()
            for t in load:
                t.join()
        wait_replicas(1)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        stop_serve()
