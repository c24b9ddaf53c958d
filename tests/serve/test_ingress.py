"""Two `raylm serve` on one host, each with a Ray of its own, the second started while the first serves: the
second's port answers for the second alone through its start-up and a restart of its replica, and its /health is
200 only once its own replica serves (serve/ingress.py says how they answered for each other)."""

import os
import signal
import time

import httpx2 as httpx
import pytest

from engine import network
from engine.network import free_port
from serve import ingress
from tests.serve.raylm_serve import START_BOUND_S, RaylmServe, listening_ports, session

REPLICA = "ServeReplica:raylm:LLMServer"
# Each request's bound: short, so that polls go on while the server cannot answer (a request then waits in Serve's
# fallback proxy for a replica), and long enough for a tiny model's completion on a loaded machine.
REQUEST_S = 5


def test_each_process_picks_its_own_ports_and_keeps_an_operators(monkeypatch):
    """A `raylm serve` started by a process that picked the ports (a test session, a benchmark) inherits them: it
    picks its own. One an operator set stays. No port picked lies in a replica range."""
    fallback, stats = "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_HAPROXY_STATS_PORT"
    env = {"PATH": os.environ["PATH"], fallback: "18500", stats: "18404"}  # the parent's pick, the operator's
    monkeypatch.setattr(os, "environ", {**env, ingress.PICKED_ENV: f"{os.getppid()} {fallback}"})
    ingress.use_fast_ingress()
    singles = [int(os.environ[name]) for name in ingress.SIDE_PORT_ENV]
    ranges = [range(int(os.environ[low]), int(os.environ[high])) for low, high in ingress.REPLICA_PORT_ENV.items()]
    assert os.environ[fallback] != "18500" and os.environ[stats] == "18404"
    assert len(set(singles)) == len(singles) and all(len(r) == ingress.REPLICA_PORTS for r in ranges)
    assert not set(ranges[0]) & set(ranges[1]) and not set(singles) & {*ranges[0], *ranges[1]}
    # Outside the kernel's ephemeral range: an outgoing connection cannot hold one when Serve comes to listen.
    assert max(*singles, *ranges[0], *ranges[1]) < network.ephemeral_ports_low()
    picked = {name: os.environ[name] for name in (*ingress.SIDE_PORT_ENV, *ingress.REPLICA_PORT_ENV)}
    ingress.use_fast_ingress()  # again in the process that picked them: its Ray may already listen on them
    assert {name: os.environ[name] for name in picked} == picked


def test_no_picked_range_covers_a_port_an_operator_set(monkeypatch):
    """The first range the OS offers holds the operator's stats port: it is passed over."""
    stats = "RAY_SERVE_HAPROXY_STATS_PORT"
    monkeypatch.setattr(os, "environ", {"PATH": os.environ["PATH"], stats: "20010"})
    offered = iter([range(20000, 20000 + ingress.REPLICA_PORTS)])
    real = ingress.free_port_range
    monkeypatch.setattr(ingress, "free_port_range", lambda count: next(offered, None) or real(count))
    ingress.use_fast_ingress()
    assert os.environ[stats] == "20010"
    for low, high in ingress.REPLICA_PORT_ENV.items():
        assert not int(os.environ[low]) <= 20010 < int(os.environ[high])


class Client:
    """Polls one server's port: its /health, /v1/models and a completion asking each server's model. Records how
    often it answered as the other server, and /health 200 with this server's model not listed right after (the
    replica that answered /health then serves another model, or none)."""

    def __init__(self, url: str, own: str, other: str) -> None:
        self.url, self.own, self.other = url, own, other
        self.polls = self.as_other = self.health_before_serving = 0
        self.seen: list[str] = []

    def _get(self, path: str) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.url}{path}", timeout=REQUEST_S)
        except httpx.TransportError:
            return None

    def _complete(self, model: str) -> httpx.Response | None:
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
        try:
            return httpx.post(f"{self.url}/v1/completions", json=body, timeout=REQUEST_S)
        except httpx.TransportError:
            return None

    def poll(self) -> bool:
        """One poll; whether this server's model served a completion."""
        health, models = self._get("/health"), self._get("/v1/models")
        other, own = self._complete(self.other), self._complete(self.own)
        lists = {m["id"] for m in models.json()["data"]} if models is not None and models.status_code == 200 else set()
        answered_as_other = self.other in lists or (other is not None and other.status_code == 200)
        self.polls += 1
        self.as_other += answered_as_other
        # /v1/models asked right after /health: unanswered, it says nothing of what /health answered for.
        self.health_before_serving += (
            health is not None and health.status_code == 200 and models is not None and self.own not in lists
        )
        self.seen.append(
            f"health={health and health.status_code} models={sorted(lists)} {self.other}={other and other.status_code}"
            f" {self.own}={own and own.status_code}"
        )
        return own is not None and own.status_code == 200 and own.json()["model"] == self.own

    def check(self, when: str) -> None:
        print(
            f"{when}: {self.polls} polls, {self.as_other} answered as {self.other}, /health 200 before serving "
            f"{self.health_before_serving}"
        )
        assert self.as_other == 0 and self.health_before_serving == 0, "\n".join(self.seen)


@pytest.fixture(scope="module")
def model(servable_tiny_model) -> str:
    return servable_tiny_model()


def replicas(server: RaylmServe) -> set[int]:
    return {pid for pid, cmdline in session(server.sid).items() if REPLICA in cmdline}


def test_two_servers_on_one_host_never_answer_for_each_other(model, tmp_path):
    servers = []
    try:
        alpha = RaylmServe(model, free_port(), tmp_path / "alpha.log", "--served-model-name", "alpha")
        servers.append(alpha)
        alpha.wait_serving()
        beta = RaylmServe(model, free_port(), tmp_path / "beta.log", "--served-model-name", "beta")
        servers.append(beta)
        client = Client(beta.url, "beta", "alpha")
        deadline = time.monotonic() + START_BOUND_S
        while not (client.poll() and beta.serving()):
            assert beta.proc.poll() is None and time.monotonic() < deadline, beta.output()[-3000:]
            time.sleep(0.25)
        client.check("beta's start-up beside alpha")
        shared = listening_ports(alpha.sid) & listening_ports(beta.sid)
        assert not shared, f"both servers listen on {shared} (SO_REUSEPORT): the kernel picks which one answers"

        client = Client(beta.url, "beta", "alpha")
        (killed,) = replicas(beta)
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + START_BOUND_S
        while not (client.poll() and replicas(beta) - {killed}):
            assert time.monotonic() < deadline, f"beta's replica not back after {START_BOUND_S} s: {client.seen[-5:]}"
            time.sleep(0.25)
        client.check("beta's replica killed and restarted")
    finally:
        for server in servers:
            server.kill_session()
