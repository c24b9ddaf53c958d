"""Tensor parallelism across hosts: each Ray node on a host of its own (a network namespace with its own
address and interfaces, tests/hosts.py), so the process group's traffic crosses links between hosts and
an address or interface that only works locally fails here as it would between machines.

The hosts: the head (1 CPU: only the scheduler fits there) and two workers (2 CPUs: one rank each under
STRICT_SPREAD). w1 has a second interface on a link that reaches no other host, and its host name resolves to
that interface's address: where gloo binds by default. Drivers run inside the head (hosts_driver.py)."""

import json
import re
import subprocess
from collections.abc import Iterator

import pytest

from engine.inprocess import InProcessEngine
from raylm import LLM, SamplingParams
from tests.engine.test_ray_engine import config, run_to_completion
from tests.hosts import VENV_BIN, Network, report_of, why_hosts_cannot_be_made
from tests.workers.test_models import QWEN3_MOE

DRIVER_TIMEOUT_S = 180
RENDEZVOUS_TIMEOUT_S = 10
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tp_hosts() -> Iterator[Network]:
    if reason := why_hosts_cannot_be_made():
        pytest.skip(reason)
    net = Network.create()
    try:
        head, w1, w2 = (net.add_host(n) for n in ("head", "w1", "w2"))
        net.add_dead_end(w1, "10.251.0")
        net.start_ray(head, num_cpus=1)
        for w in (w1, w2):
            net.start_ray(w, num_cpus=2, head=head)
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def moe_model(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3_moe", None, **QWEN3_MOE)


@pytest.fixture(scope="module")
def engine_reports(tp_hosts, model, moe_model) -> dict[str, dict]:
    """The tp2, pd and ep2 drivers' reports, run one after another in one driver process on the head."""
    calls = [["tp2", model], ["pd", model], ["ep2", moe_model]]
    return tp_hosts.driver(tp_hosts.hosts["head"], "several", json.dumps(calls), timeout_s=3 * DRIVER_TIMEOUT_S)


def test_tp2_across_hosts_matches_tp1_with_the_scheduler_on_the_head(tp_hosts, model, engine_reports):
    head, w1, w2 = tp_hosts.hosts.values()
    report = report_of(engine_reports, "tp2")
    assert report["strategy"] == "STRICT_SPREAD"
    scheduler, *ranks = report["ips"]
    assert scheduler == head.ip and sorted(ranks) == sorted([w1.ip, w2.ip])
    # The group meets at rank 0's address on the hosts' link, and every rank's gloo listens on that link
    # (eth0), not where w1's host name points (its dead-end eth1).
    assert report["master"] == ranks[0]
    assert report["ifnames"] == ["eth0", "eth0"]
    assert report["outputs"] == run_to_completion(InProcessEngine(config(model)))


def test_kv_moves_between_engines_on_two_hosts_giving_the_unified_tokens(tp_hosts, model, engine_reports):
    """Prefill/decode disaggregation across hosts: one engine on each worker host, the prompt's KV crossing
    between them through the object store, with and without the decode engine holding the prefixes."""
    head, w1, w2 = tp_hosts.hosts.values()
    report = report_of(engine_reports, "pd")
    assert sorted(report["ips"]) == sorted([w1.ip, w2.ip])
    expected = run_to_completion(InProcessEngine(config(model)))
    assert report["outputs"] == expected + expected
    assert report["kv_bytes"] > 0


def test_expert_parallel_across_hosts_matches_tp1(tp_hosts, moe_model, engine_reports):
    head, w1, w2 = tp_hosts.hosts.values()
    report = report_of(engine_reports, "ep2")
    assert sorted(report["ips"][1:]) == sorted([w1.ip, w2.ip])
    assert report["outputs"] == run_to_completion(InProcessEngine(config(moe_model)))


def test_pp2_across_hosts_through_raylm_generate_matches_one_rank(tp_hosts, servable_tiny_model):
    """One stage on each worker host (STRICT_SPREAD), the scheduler on the head: the hidden states of every step
    cross from w1 to w2, the sampled ids come back, and the text is the single-rank engine's."""
    head = tp_hosts.hosts["head"]
    model = servable_tiny_model()
    llm = LLM(model=model, executor="inprocess")
    try:
        (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    expected = out.outputs[0].text
    assert expected.strip()
    done = subprocess.run(
        head.cmd(
            str(VENV_BIN / "raylm"),
            "generate",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "12",
            "--model",
            model,
            "--address",
            f"{head.ip}:6379",
            "--pipeline-parallel-size",
            "2",
            "--num-threads",
            "2",
            "--placement-strategy",
            "STRICT_SPREAD",
        ),
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert expected in done.stdout, (expected, done.stdout[-2000:])


def test_gloo_on_an_interface_the_other_hosts_cannot_reach_fails_naming_the_setting(tp_hosts, model):
    # `lo` is what a host name resolving to 127.0.1.1 (Debian's default) amounts to: each rank listens where
    # only its own host can connect.
    head = tp_hosts.hosts["head"]
    report = tp_hosts.driver(
        head, "tp2_with_ifname", model, "lo", str(RENDEZVOUS_TIMEOUT_S), timeout_s=DRIVER_TIMEOUT_S
    )
    assert report["error"] is not None, "the ranks met over loopback across hosts"
    print(f"gloo on lo: failed after {report['elapsed_s']:.1f} s: {report['error']}")
    assert "GLOO_SOCKET_IFNAME=lo" in report["error"] and "Set GLOO_SOCKET_IFNAME" in report["error"]
    assert set(report["groups"]) == {"REMOVED"}


BAD_INPUT = ["no host at the address", "wrong port", "more hosts than exist"]


@pytest.fixture(scope="module")
def bad_input_runs(tp_hosts, tiny_model_dir, tmp_path_factory) -> dict[str, tuple[str, int, str]]:
    """Each BAD_INPUT case's `raylm generate` from the head, all three at once (each mostly waits out the
    placement timeout): case -> (the error it must name, its exit status, its stderr)."""
    head = tp_hosts.hosts["head"]
    # tp=3 needs a model whose heads split three ways; STRICT_SPREAD then wants 4 hosts, and there are 3.
    model = tiny_model_dir("llama", hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)
    cases = dict(
        zip(
            BAD_INPUT,
            [
                (f"{tp_hosts.subnet}.99:6379", 1, f"no Ray head answers at {tp_hosts.subnet}.99"),
                (f"{head.ip}:6380", 1, f"no Ray head answers at {head.ip}:6380"),
                (f"{head.ip}:6379", 3, "STRICT_SPREAD puts each bundle .* it needs 4 nodes"),
            ],
        )
    )
    logs = tmp_path_factory.mktemp("bad-input")
    runs = {}
    try:
        for i, (case, (address, tp, _)) in enumerate(cases.items()):
            with open(logs / f"{i}.err", "w") as stderr:
                runs[case] = subprocess.Popen(
                    head.cmd(
                        str(VENV_BIN / "raylm"),
                        *("generate", "--prompt", "hi", "--model", model, "--address", address),
                        *("--tensor-parallel-size", str(tp), "--num-threads", "1"),
                        *("--placement-strategy", "STRICT_SPREAD", "--placement-timeout-s", str(RENDEZVOUS_TIMEOUT_S)),
                    ),
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
        # Bounded: a silent wait instead of the error fails the test by TimeoutExpired (the timeout, plus three
        # processes starting Python and torch at once on a small machine).
        statuses = {case: proc.wait(RENDEZVOUS_TIMEOUT_S + 60) for case, proc in runs.items()}
        return {case: (cases[case][2], statuses[case], (logs / f"{i}.err").read_text()) for i, case in enumerate(cases)}
    finally:
        for proc in runs.values():
            proc.kill()


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_fails_within_placement_timeout_naming_what_is_missing(bad_input_runs, case):
    expected, status, stderr = bad_input_runs[case]
    assert status != 0
    assert re.search(expected, stderr), stderr[-3000:]
