"""Starting the app: what `start` sets up before Ray exists."""

import os

import pytest

from cluster.config import EngineConfig
from cluster.serve import app
from cluster.serve.options import AppArgs

MIN_DRAINING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


class RayStarting(Exception):
    pass


def _env_when_ray_starts(monkeypatch, address, preset=None):
    """`start(address=...)` up to its `connect`: the drain window Ray's processes would inherit."""
    seen = {}

    def connect(address, min_cpus):
        seen["period"] = os.environ.get(MIN_DRAINING)
        raise RayStarting

    if preset is None:
        monkeypatch.delenv(MIN_DRAINING, raising=False)
    else:
        monkeypatch.setenv(MIN_DRAINING, preset)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(app.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(app, "connect", connect)
    with pytest.raises(RayStarting):
        app.start(AppArgs(engine=EngineConfig(model="/m")), address=address)
    return seen["period"]


def test_a_ray_of_our_own_keeps_stopping_replicas_reachable_for_seconds_not_30(monkeypatch):
    assert float(_env_when_ray_starts(monkeypatch, None)) == app.LOCAL_MIN_DRAINING_PERIOD_S


def test_joining_a_cluster_leaves_its_drain_window_alone(monkeypatch):
    # Its load balancers may need Serve's 30 s to deregister a replica.
    assert _env_when_ray_starts(monkeypatch, "10.0.0.1:6379") is None


def test_an_operators_own_drain_window_wins(monkeypatch):
    assert _env_when_ray_starts(monkeypatch, None, preset="12") == "12"
