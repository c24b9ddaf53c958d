"""A host lost mid-generation: Serve runs tp=2 with each rank on a worker host of its own (tests/hosts.py);
killing one rank's host (its Ray node and every process on it) must end every in-flight stream with an error
within a bound, turn /health red naming the lost node, and Serve must replace the replica with an engine on the
hosts that remain.

The hosts: the head (2 CPUs: the replica and the scheduler) and three workers (2 CPUs: one rank each), so after
one worker is lost two remain for the new engine's ranks. Every `ray start` sets GLOO_SOCKET_IFNAME=eth0, as
docs/multinode.md says to."""

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.inprocess import InProcessEngine
from tests.engine.test_ray_engine import config, run_to_completion
from tests.hosts import Network, report_of, why_hosts_cannot_be_made
from tests.hosts_driver import SERVING_BOUND_S

DRIVER_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def serve_hosts() -> Iterator[Network]:
    if reason := why_hosts_cannot_be_made():
        pytest.skip(reason)
    net = Network.create()
    try:
        head, *workers = (net.add_host(n) for n in ("head", "w1", "w2", "w3"))
        net.start_ray(head, num_cpus=2)
        for w in workers:
            net.start_ray(w, num_cpus=2, head=head, env={"GLOO_SOCKET_IFNAME": "eth0"})
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def served_model(tiny_model_dir, default_model_dir) -> str:
    """A tiny random Llama that generates for minutes (4096 positions, ignore_eos), with the default model's
    tokenizer so Serve can detokenize (its vocabulary covers the tiny model's 256 ids)."""
    path = tiny_model_dir("llama", max_position_embeddings=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_dir) / name, Path(path) / name)
    return path


PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def driver_reports(serve_hosts, served_model) -> dict[str, dict]:
    """The serve_pp2 then lost_host drivers' reports, from one driver process on the head."""
    hosts = json.dumps({h.ip: h.ns for h in serve_hosts.hosts.values()})
    calls = [["serve_pp2", served_model, hosts, json.dumps(PROMPT)], ["lost_host", served_model, hosts]]
    return serve_hosts.driver(serve_hosts.hosts["head"], "several", json.dumps(calls), timeout_s=DRIVER_TIMEOUT_S + 300)


def test_pp2_served_across_hosts_answers_as_one_rank_does(served_model, driver_reports):
    """One stage on each of two hosts under Serve (the activations cross between them): the completion is the
    single-rank engine's."""
    (expected,) = run_to_completion(InProcessEngine(config(served_model)), prompts=[PROMPT])
    report = report_of(driver_reports, "serve_pp2")
    status, body = report["completion"]
    assert status == 200, report
    tokenizer = AutoTokenizer.from_pretrained(served_model)
    assert json.loads(body)["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    stage_hosts = report["hosts"][2:]  # PACK decides which hosts; each rank fills one (2 CPUs), so two hosts
    assert len(set(stage_hosts)) == 2, report


def test_a_host_lost_mid_generation_fails_its_streams_and_serve_rebuilds_on_the_rest(serve_hosts, driver_reports):
    hosts = {h.ip: h.ns for h in serve_hosts.hosts.values()}
    report = report_of(driver_reports, "lost_host")
    victim_ip = next(ip for ip, ns in hosts.items() if ns == report["victim"])
    print(
        f"\nlost host {victim_ip}: in-flight streams errored after "
        f"{', '.join(f'{t:.2f}' for t in report['error_after_s'])} s; serving again after "
        f"{report['serving_after_s'] and round(report['serving_after_s'], 1)} s; /health said {report['health']}"
    )
    assert all('"error"' in e for e in report["last_events"]), report["last_events"]
    status, body = report["health"]
    assert status == 503 and f"rank {report['rank']} on node {victim_ip}" in body, report["health"]
    assert report["serving_after_s"] is not None, f"not serving again within {SERVING_BOUND_S} s"
    assert report["victim"] not in report["ranks_after"]
