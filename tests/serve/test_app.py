"""Starting the app: what `start` sets up and checks before Ray exists."""

import os
import socket
import subprocess
import sys

import pytest
from ray import serve

from engine.config import EngineConfig
from engine.network import free_port
from serve import app
from serve.options import AppArgs
from tests.serve.test_server import stop_serve

MIN_DRAINING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


class RayStarting(Exception):
    pass


def _start_until_ray_starts(monkeypatch, address, port=None, grpc_port=None, args=None) -> dict:
    """`start(address=...)` with no Ray yet, up to its `connect` (which raises RayStarting): returns the
    environment Ray's processes would inherit, and the CPUs asked of Ray as MIN_CPUS."""
    seen = {}

    def connect(address, min_cpus):
        seen.update(os.environ, MIN_CPUS=min_cpus)
        raise RayStarting

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(app.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(app, "connect", connect)
    with pytest.raises(RayStarting):
        app.start(
            args or AppArgs(engine=EngineConfig(model="/m")),
            address=address,
            port=port or free_port(),
            grpc_port=grpc_port or free_port(),
        )
    return seen


def test_the_app_imports_no_model_stack():
    """`raylm serve`'s own process builds and deploys the app, and a replica reads the checkpoints only after its
    ranks have started (RayEngine): neither imports torch or transformers with the app's modules (seconds of CPU on
    each start)."""
    code = (
        "import sys, serve.app; print(sorted({m.partition('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_serve_config_with_pd_deploys_the_prefill_engines_beside_the_llm_server():
    application = app.build_app(
        {"model": "/m", "pd": True, "prefill_config": {"tensor_parallel_size": 2, "max_replicas": 3}}
    )
    server = application._bound_deployment  # Serve has no public view of an application's deployments
    prefill = server.init_args[1]._bound_deployment
    assert (server.name, prefill.name) == ("LLMServer", "PrefillServer")
    assert prefill.init_args[0].engine.tensor_parallel_size == 2
    assert prefill._deployment_config.autoscaling_config.max_replicas == 3
    assert len(prefill._replica_config.placement_group_bundles) == 4  # the replica's, the scheduler's, two ranks'
    assert app.build_app({"model": "/m"})._bound_deployment.init_args[1] is None


def test_a_ray_of_our_own_has_cpus_for_every_prefill_replica_too(monkeypatch):
    args = AppArgs(
        engine=EngineConfig(model="/m"), pd=True, prefill_config={"tensor_parallel_size": 2, "max_replicas": 3}
    )
    # The decode replica (its own, the scheduler's, one rank's), and three prefill replicas (theirs, two ranks').
    assert _start_until_ray_starts(monkeypatch, None, args=args)["MIN_CPUS"] == 3 + 3 * 4


def _env_when_ray_starts(monkeypatch, address, preset=None):
    """The drain window Ray's processes would inherit."""
    if preset is None:
        monkeypatch.delenv(MIN_DRAINING, raising=False)
    else:
        monkeypatch.setenv(MIN_DRAINING, preset)
    return _start_until_ray_starts(monkeypatch, address).get(MIN_DRAINING)


def test_a_ray_of_our_own_keeps_stopping_replicas_reachable_for_seconds_not_30(monkeypatch):
    assert float(_env_when_ray_starts(monkeypatch, None)) == app.LOCAL_MIN_DRAINING_PERIOD_S


def test_joining_a_cluster_leaves_its_drain_window_alone(monkeypatch):
    # Its load balancers may need Serve's 30 s to deregister a replica.
    assert _env_when_ray_starts(monkeypatch, "10.0.0.1:6379") is None


def test_an_operators_own_drain_window_wins(monkeypatch):
    assert _env_when_ray_starts(monkeypatch, None, preset="12") == "12"


@pytest.mark.parametrize("flag", ["port", "grpc_port"])
def test_a_port_another_process_holds_is_refused_before_ray_starts_naming_its_flag(monkeypatch, flag):
    # Otherwise HAProxy finds out once Ray and Serve are up, and raylm serve dies with a Ray traceback.
    with socket.create_server(("127.0.0.1", 0)) as held:
        busy = held.getsockname()[1]
        with pytest.raises(
            ValueError,
            match=f"--{flag.replace('_', '-')} {busy}: cannot listen on 127.0.0.1:{busy}: Address already in use",
        ):
            _start_until_ray_starts(monkeypatch, None, **{flag: busy})


def test_an_internal_port_another_process_holds_is_refused_before_ray_starts_naming_its_variable(monkeypatch):
    # An operator's choice (use_fast_ingress picks free ones otherwise): Serve's fallback proxy would fail later.
    with socket.create_server(("127.0.0.1", 0)) as held:
        busy = held.getsockname()[1]
        monkeypatch.setenv("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", str(busy))
        with pytest.raises(
            ValueError,
            match=rf"^\$RAY_SERVE_FALLBACK_PROXY_HTTP_PORT {busy}: cannot listen on 0.0.0.0:{busy}: Address already in use",
        ):
            _start_until_ray_starts(monkeypatch, None)


def test_joining_a_cluster_leaves_the_ports_to_it(monkeypatch):
    # The cluster's own Serve may hold them already: a redeploy joins it.
    with socket.create_server(("127.0.0.1", 0)) as held:
        _start_until_ray_starts(monkeypatch, "10.0.0.1:6379", port=held.getsockname()[1])


def test_a_start_asking_other_ports_than_a_running_serve_is_refused_at_once_naming_both(ray_session):
    # serve.start would keep the running Serve's ports with only a log line, and start() would then wait for
    # /health where nobody listens (up to its 900 s). A cluster joined: the user is told the cluster's ports.
    http, grpc = free_port(), free_port()
    stop_serve()
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": http},
            grpc_options={"port": grpc, "grpc_servicer_functions": [app.GRPC_SERVICER]},
        )
        asked = free_port()
        running = f"--host 127.0.0.1 --port {http} --grpc-port {grpc}"
        with pytest.raises(
            ValueError,
            match=f"^--host 127.0.0.1 --port {asked} --grpc-port {grpc}: Serve, started "
            f"earlier in this process, already listens at {running}, ",
        ):
            app.start(AppArgs(engine=EngineConfig(model="/m")), port=asked, grpc_port=grpc)
        with pytest.raises(ValueError, match=f"the cluster's Serve already listens at {running}, .*pass those"):
            app.check_serve_ports("127.0.0.1", http, asked, joined=True)
        app.check_serve_ports("127.0.0.1", http, grpc, joined=True)  # its own ports: a redeploy goes ahead
    finally:
        stop_serve()
