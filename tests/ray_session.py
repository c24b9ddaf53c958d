"""The session's Ray: one local instance shared by every test that asks for it (Ray takes ~15 s
to start on a 2-core machine, so starting one per module or test would dominate the run)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import ray

from serve.ingress import use_fast_ingress

# The session's Ray serves through the same ingress as `raylm serve` (HAProxy, replicas serving HTTP), whose
# settings Ray's processes, and ray.serve in this one, read from the environment they start with.
use_fast_ingress()
from serve.lifecycle import haproxy_dies_with_its_parent  # noqa: E402  (after the ingress settings)

# Logical CPUs only count reservations (the engine sets torch threads from the real cores): 10 hold
# two tp=2 engines at once (1 scheduler + 2 rank bundles each) on these 2-core machines, or three replicas
# of a one-thread engine and a ModelRouter (tests/serve/test_models.py).
SESSION_CPUS = 10
# Replicas' metrics reach Ray's export once per report period (10 s by default); tests read them within 1 s.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
# A replica that Serve stops (shutdown, scale-down, replacement) in direct-ingress mode first drains for this long
# so that load balancers elsewhere stop sending to it: 30 s by default, added to every Serve module's teardown.
# The tests' HAProxy runs on this machine and is reconfigured at once.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")


@pytest.fixture(scope="session")
def ray_session():
    """Start the session's local Ray on first use; reuse it if something already started one."""
    if not ray.is_initialized():
        haproxy_dies_with_its_parent()  # a killed test run leaves no HAProxy holding a port, as raylm serve
        ray.init(num_cpus=SESSION_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def servable_tiny_model(tiny_model_dir, default_model_dir):
    """`servable_tiny_model(model_type="llama", **config_overrides)` -> a tiny random model (a Llama by default)
    holding the default model's tokenizer and chat template, and a vocabulary as large as that tokenizer's, so Serve
    can take any text for a model that generates in milliseconds."""
    vocab_size = json.loads((Path(default_model_dir) / "config.json").read_text())["vocab_size"]

    def make(model_type: str = "llama", **overrides) -> str:
        path = tiny_model_dir(model_type, **{"vocab_size": vocab_size, **overrides})
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (Path(default_model_dir) / name).exists():
                shutil.copy(Path(default_model_dir) / name, Path(path) / name)
        return path

    return make
