"""Assembling the application and starting it: Ray, Serve's HTTP and gRPC ingress, the deployment."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import time
import urllib.request
from typing import Any

import ray
from ray import serve
from ray.serve._private.constants import (
    RAY_SERVE_ENABLE_HA_PROXY,
    SERVE_CONTROLLER_NAME,
    SERVE_LOGGER_NAME,
    SERVE_NAMESPACE,
)
from ray.serve.context import _disconnect, _get_global_client
from ray.serve.exceptions import RayServeException

from engine.config import check_served_names, per_model_settings
from engine.connect import connect, starts_local_ray, without_log_lines
from engine.placement import engine_bundles
from serve.ingress import side_ports
from serve.lifecycle import LocalRayLost, StopSignals, haproxy_dies_with_its_parent, while_local_ray_lives
from serve.model_router import ModelRouter, RoutedLLMServer
from serve.options import REPLICA_CPUS, AppArgs, deployment_options, uses_prefix_cache_router
from serve.pd import PrefillServer
from serve.router import RouteServer
from serve.server import LLMServer

APP_NAME = "raylm"
GRPC_SERVICER = "serve.raylm_pb2_grpc.add_RayLMServicer_to_server"
LOCAL_MIN_DRAINING_PERIOD_S = 2.0


def build_app(args: dict[str, Any] | AppArgs | list[AppArgs]) -> serve.Application:
    """The application, from ``serve run serve:build_app model=PATH max_replicas=4`` (or a Serve config's
    ``args``, or ``raylm serve``). The API key is ``api_key`` or else $RAYLM_API_KEY. Several models (a list, or
    ``models`` in the args: config.per_model_settings) are one deployment each behind a ModelRouter."""
    apps = [with_env_api_key(a) for a in app_args_list(args)]
    if len(apps) == 1:
        return model_deployment(apps[0])
    servers = {a.model_name: model_deployment(a, f"LLMServer-{i}") for i, a in enumerate(apps)}
    return ModelRouter.options(
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        max_ongoing_requests=sum(deployment_options(a)["max_ongoing_requests"] for a in apps),
    ).bind(servers, max(a.max_body_bytes for a in apps))


def app_args_list(args: dict[str, Any] | AppArgs | list[AppArgs]) -> list[AppArgs]:
    if isinstance(args, AppArgs):
        return [args]
    if isinstance(args, list):
        return args
    apps = [AppArgs.from_flat(values) for values in per_model_settings(args)]
    check_served_names(apps)
    return apps


def with_env_api_key(args: AppArgs) -> AppArgs:
    if args.api_key is None and os.environ.get("RAYLM_API_KEY"):
        return args.model_copy(update={"api_key": os.environ["RAYLM_API_KEY"]})
    return args


def model_deployment(app_args: AppArgs, name: str | None = None) -> serve.Application:
    """One model's LLMServer deployment, with the prefix-cache router when it is the app's ingress (a model behind
    a ModelRouter is reached through handles, where Serve's request router balances by load), and with ``pd`` its
    PrefillServer deployment, which the LLMServer's replicas call."""
    options = deployment_options(app_args)
    prefill = prefill_deployment(app_args, name)
    if name is not None:
        return RoutedLLMServer.options(**options, name=name).bind(app_args, prefill)
    server = LLMServer.options(**options).bind(app_args, prefill)
    if uses_prefix_cache_router(app_args) and RAY_SERVE_ENABLE_HA_PROXY:
        # HAProxy bypasses the deployment's request router unless an ingress request router asks it (router.py).
        return server._with_ingress_request_router(RouteServer.bind(server, app_args))
    return server


def prefill_deployment(app_args: AppArgs, name: str | None) -> serve.Application | None:
    """``pd``'s prefill deployment: PrefillServer, or PrefillServer-i beside a ModelRouter's LLMServer-i."""
    prefill = app_args.prefill
    if prefill is None:
        return None
    suffix = "" if name is None else name.removeprefix("LLMServer")
    return PrefillServer.options(**deployment_options(prefill), name=f"PrefillServer{suffix}").bind(prefill)


def start(
    args: AppArgs | list[AppArgs],
    *,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: int = 9000,
    timeout_s: float = 900.0,
) -> str:
    """Start or join Ray, deploy the app with Serve's HTTP and gRPC proxies, and return the URL once /health answers."""
    start_ray(args, address, host, port, grpc_port)
    check_serve_ports(host, port, grpc_port, joined=not starts_local_ray(address))
    serve.start(
        http_options={"host": host, "port": port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
    )
    # serve.run connects to the Serve just started (or that check_serve_ports found on these ports) and says its
    # "New http_options/controller_options will not be applied": options it was never given, on every start.
    with without_log_lines(SERVE_LOGGER_NAME, "Connecting to existing Serve app"):
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    wait_healthy(url, timeout_s)
    return url


def start_ray(args: AppArgs | list[AppArgs], address: str | None, host: str, port: int, grpc_port: int) -> None:
    """Join the cluster at ``address``, or start a Ray of our own set up for serving; nothing if Ray is up."""
    if starts_local_ray(address) and not ray.is_initialized():
        # Nothing of ours can hold the ports yet: a taken one is another process's, and HAProxy would only find
        # out once Ray and Serve are up, as a Ray traceback. (A cluster joined may hold them with its own Serve.)
        check_ports_free(host, {"--port": port, "--grpc-port": grpc_port})
        check_ports_free("0.0.0.0", side_ports())  # HAProxy binds them on every interface
        # Serve keeps a stopping replica reachable for 30 s so that an external load balancer can deregister it;
        # a Ray of our own has none, only Serve's HAProxy on this node, which a config reload updates at once.
        # Without this, every scale-down and `raylm serve`'s Ctrl-C waits 30 s even when idle. Set before Ray
        # starts: its controller and replicas read it at import.
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", str(LOCAL_MIN_DRAINING_PERIOD_S))
        haproxy_dies_with_its_parent()  # else a killed raylm leaves HAProxy holding the port (lifecycle.py)
    # A local Ray gets logical CPUs for every replica's reservations (engine_bundles plus the replica's own).
    apps = app_args_list(args)
    deployments = [d for a in apps for d in (a, a.prefill) if d is not None]
    cpus = sum(
        d.max_replicas * (REPLICA_CPUS + sum(b.get("CPU", 0) for b in engine_bundles(d.engine, False)))
        for d in deployments
    )
    connect(address, cpus + (REPLICA_CPUS if len(apps) > 1 else 0))  # a ModelRouter's replica


def check_serve_ports(host: str, port: int, grpc_port: int, *, joined: bool) -> None:
    """Raise ValueError naming both ports when Serve already runs in this Ray and listens elsewhere than asked:
    serve.start would keep its ports with only a log line, and /health would be awaited where nobody listens."""
    try:
        client = _get_global_client()  # no public way to read a running Serve's options
    except RayServeException:  # no Serve yet
        return
    http = client.http_config
    grpc = ray.get(client._controller.get_grpc_config.remote())
    if (http.host, http.port, grpc.port) == (host, port, grpc_port):
        return
    asked, running = (
        f"--host {h} --port {p} --grpc-port {g}"
        for h, p, g in ((host, port, grpc_port), (http.host, http.port, grpc.port))
    )
    if joined:
        raise ValueError(
            f"{asked}: the cluster's Serve already listens at {running}, and Serve keeps the ports "
            f"it started with: pass those, or stop its Serve first (`serve shutdown`)"
        )
    raise ValueError(
        f"{asked}: Serve, started earlier in this process, already listens at {running}, and Serve "
        f"keeps the ports it started with: ask for those, or stop it first (serve.shutdown())"
    )


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Raise ValueError naming the flag (``--host`` or one of ``ports``) that stops a listener on host:port."""
    for flag, port in ports.items():
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except socket.gaierror as e:
            raise ValueError(f"--host {host}: {e.strerror}") from None
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no owner
            try:
                s.bind(address)
            except OSError as e:
                hint = (
                    (
                        " (another server holds it, or an HAProxy that `ray stop --force` left behind); stop it "
                        f"or pass another {flag}"
                    )
                    if e.errno == errno.EADDRINUSE
                    else ""
                )
                raise ValueError(f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror}{hint}") from None


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(0.5)


def serve_until_interrupted(
    args: AppArgs | list[AppArgs], *, address: str | None, host: str, port: int, grpc_port: int
) -> None:
    """`raylm serve`: deploy, print where, and keep serving until Ctrl-C or SIGTERM, which drain the app, stop
    what this process started and return (exit status 0); a second one stops at once (SystemExit 130 or 143).
    A failed start stops what it started, then raises."""
    signals = StopSignals()
    signals.install()
    own_ray = starts_local_ray(address) and not ray.is_initialized()
    deployed = serving = False
    try:
        _start_ray(args, address, host, port, grpc_port, signals)
        check_serve_ports(host, port, grpc_port, joined=not starts_local_ray(address))
        # From here a stop deletes the app: on a cluster joined, an app left deploying would serve on unseen.
        deployed = True
        url = start(args, address=address, host=host, port=port, grpc_port=grpc_port)
        serving = True
        print(
            f"raylm: serving {', '.join(a.model_name for a in app_args_list(args))} at {url}/v1 (OpenAI API) and gRPC on port {grpc_port}; "
            f"Ctrl-C or SIGTERM stops",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        what = (
            f"requests in flight get up to drain_timeout_s={max(a.drain_timeout_s for a in app_args_list(args)):g} s"
            if serving
            else "it was still starting"
        )
        print(f"raylm: {signals.name()}: stopping; {what} (a second Ctrl-C or SIGTERM stops at once)", flush=True)
        _stop(address, deployed, own_ray, signals)
        print("raylm: stopped", flush=True)
    except BaseException:
        _stop(address, deployed, own_ray, signals)
        raise


def _start_ray(
    args: AppArgs | list[AppArgs], address: str | None, host: str, port: int, grpc_port: int, signals: StopSignals
) -> None:
    """start_ray, a stop signal during it included, with our signal handlers in place again after."""
    try:
        with signals.recording() as seen:
            start_ray(args, address, host, port, grpc_port)
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        # ray.init's own SIGTERM handler, sys.exit(SIGTERM), was in place while it ran.
        signals.received.append(signal.SIGTERM)
        raise KeyboardInterrupt from None
    finally:
        signals.install()  # over ray.init's (lifecycle.StopSignals says why)
    if seen:  # a stop signal came, but its handler's exception was lost (StopSignals.recording)
        if not signals.received:
            signals.received.append(seen[-1])
        raise KeyboardInterrupt


def _stop(address: str | None, deployed: bool, own_ray: bool, signals: StopSignals) -> None:
    """stop_serving and end a Ray this process started, unless a stop signal interrupts: then stop at once,
    with the shell's status for that signal. Either way a further signal ends the process at once."""
    try:
        if own_ray and deployed:
            while_local_ray_lives(lambda: stop_serving(address, deployed=deployed))
        else:
            # Nothing to drain; and a stop signal lost in an at-fork callback while ray.init ran can leave
            # logging's lock held by this thread, which a thread of the watch would wait on forever (CI saw it).
            stop_serving(address, deployed=deployed)
        if own_ray:
            ray.shutdown()
    except LocalRayLost as e:
        print(f"raylm: {e}", flush=True)
        sys.stderr.flush()
        # Not SystemExit: at exit Ray's own shutdown would wait on the daemons that are gone; the kernel ends
        # what is left of them (lifecycle.py).
        os._exit(signals.exit_status())
    except KeyboardInterrupt:
        signals.restore_defaults()
        print(f"raylm: {signals.name()} again: stopping at once; streams in flight are cut", flush=True)
        if deployed and not own_ray and ray.is_initialized():
            with contextlib.suppress(Exception):  # the cluster drains and deletes the app without us
                serve.delete(APP_NAME, _blocking=False)
        # A Ray of our own ends with this process: ray.shutdown at exit, and the kernel for what it misses.
        raise SystemExit(signals.exit_status()) from None
    signals.restore_defaults()


def stop_serving(address: str | None, *, deployed: bool = True) -> None:
    """Delete the app (if this process deployed it), then shut Serve down if the Ray is our own. Nothing to do
    before Ray or Serve started."""
    if not ray.is_initialized():
        return
    # Deleting the app drains its replicas (serve/drain.py) while HAProxy still carries their streams;
    # serve.shutdown alone would take HAProxy down with them and cut every stream without a word.
    if deployed:
        with contextlib.suppress(RayServeException):  # no Serve controller yet: no app either
            serve.delete(APP_NAME)
    if starts_local_ray(address):
        shutdown_serve()  # our own Ray: stop HAProxy too, before Ray's exit kills its manager under it


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """serve.shutdown without the warning Ray prints on every clean stop. Serve's waits on a graceful_shutdown
    task that ends only when the controller kills itself, and the driver then reports that task as failed and
    retried ("Task ServeController.graceful_shutdown failed ... killed by ray.kill"). Here the task only raises
    the controller's shutdown flag, and its end is awaited by its name leaving the cluster."""
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return  # Serve never started
    _get_global_client().shutdown_cached_handles()  # as serve.shutdown: their routers would poll a dead controller
    ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            break
        time.sleep(0.1)
    else:
        print(f"raylm: Serve's controller still running {timeout_s:g} s into its shutdown", flush=True)
    _disconnect()
