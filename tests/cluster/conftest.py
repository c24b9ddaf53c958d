"""The session's Ray: one local instance shared by every test that asks for it (Ray takes ~15 s
to start on a 2-core machine, so starting one per module or test would dominate the run)."""

import os

import pytest
import ray

# The session's Ray serves through the same ingress as `raylm serve` (HAProxy, replicas serving HTTP), whose
# settings Ray's processes read from the environment they start with.
import cluster.serve  # noqa: F401

# Logical CPUs only count reservations (the engine sets torch threads from the real cores): 8 hold
# two tp=2 engines at once (1 scheduler + 2 rank bundles each) on these 2-core machines.
SESSION_CPUS = 8
# Replicas' metrics reach Ray's export once per report period (10 s by default); tests read them within 1 s.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")


@pytest.fixture(scope="session")
def ray_session():
    """Start the session's local Ray on first use; reuse it if something already started one."""
    if not ray.is_initialized():
        ray.init(num_cpus=SESSION_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
