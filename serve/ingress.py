"""How HTTP reaches a replica: HAProxy in front of replicas that serve HTTP themselves (Ray Serve's direct
ingress), instead of Ray Serve's Python proxy actor.

With the Python proxy every SSE chunk of every stream crossed two more hops: from the replica's user
event loop to its main loop (a thread hop), then to the proxy actor as one object of a Ray streaming
generator, then the proxy's own ASGI stack. Measured with ``raylm bench serve --no-work-model`` (64 streams,
2,048 tokens each, one invocation): the Python proxy spent 102 us and the replica 139 us of CPU per chunk;
with HAProxy (C) and the replica serving HTTP on its own event loop, HAProxy spends ~15 us and the replica
78 us. On a CPU node that time is taken from the ranks' torch threads, every step.

Both are Ray Serve's own modes in the pinned Ray (``RAY_SERVE_ENABLE_HA_PROXY``, and
``RAY_SERVE_THROUGHPUT_OPTIMIZED``, which turns on direct ingress, runs user code on the replica's main
loop, and buffers access logs); Serve still owns replicas, autoscaling, health checks (HAProxy checks each
replica's own port) and rolling updates. Ray reads them from the environment of each process it starts,
so they must be set before Ray starts (a local Ray started here inherits them; a cluster started with
``ray start`` or KubeRay needs them in its environment: see ``manifests/rayservice.yaml``), and before this
process imports ``ray.serve``, whose driver side reads them at import too (it refuses an ingress request
router without HAProxy). So the process that starts Serve calls ``use_fast_ingress`` first thing: `raylm
serve` before it loads the app, the test session in its conftest. An operator who sets either variable keeps
their value.
"""

import os

from engine.network import free_port_range

FAST_INGRESS_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # HAProxy hands the prefix-cache router (router.py) each POST's body, up to its buffer size:
    # 256 KiB holds prompts of tens of thousands of tokens (a longer one is routed by load), where
    # Ray's default (8 MiB) would size every HAProxy buffer for the largest body.
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(256 << 10),
    # HAProxy's proxy actor answers Serve's readiness check once HAProxy runs; Serve allows 5 s a check and kills
    # the proxy after three misses, so on a loaded node serve.start failed with ActorDiedError (CI saw it on 2
    # cores). A proxy that is merely slow to start is worth the wait.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
}
# Serve listens on more ports than --port and --grpc-port, each fixed unless its variable says otherwise: HAProxy's
# Prometheus metrics (9101) and stats page (8404), and the Python proxy HAProxy falls back to while no replica of
# the app is up (8500, and 9500 for gRPC). Two Serves on one host (two `raylm serve`, a test session beside a
# server) failed on HAProxy's, and shared the fallback's: that proxy binds with SO_REUSEPORT, so the second one's
# joined the first's socket and the kernel spread each HAProxy's fallback traffic over both instances; the second
# server answered as the first through its start-up and whenever its replica was down. So each process that starts
# Serve takes free ports of its own, and a local Ray is not started while one is taken (app.py check_ports_free).
# The fallback proxy keeps SO_REUSEPORT: Serve turns off SO_REUSEADDR with it (SERVE_SOCKET_REUSE_PORT_ENABLED=0),
# and then the next Serve on the node cannot bind the port for a minute after shutdown, while HAProxy's health
# checks of the old proxy sit in TIME_WAIT (a test's second Serve on a cluster failed so).
SIDE_PORT_ENV = (
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)
# Each replica serves HTTP and gRPC on a port of its own, which HAProxy forwards to, taken from a range (by default
# 30000-31000 and 40000-41000, the same for every Serve). Serve's gRPC servers bind with SO_REUSEPORT whatever it
# asks (it passes gRPC the option as a string, which gRPC ignores), so the first replica of a second Serve on the
# host shared the first one's gRPC port, 40000. So each Serve started here takes ranges of its own, of this many
# ports: the replicas of every deployment at once, with their replacements.
REPLICA_PORTS = 64
REPLICA_PORT_ENV = {  # the first port of each range, and the end (exclusive)
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT",
}
# "PID NAME...": the ports use_fast_ingress picked, and in which process. A `raylm serve` started by a process that
# picked them (a test session, a benchmark) inherits them with its environment, and must pick its own: they are
# the parent's Serve's, not an operator's settings.
PICKED_ENV = "RAYLM_PICKED_SERVE_PORTS"


def use_fast_ingress() -> None:
    """Put the settings in this process's environment, unless already set, for Ray and its children. Call it
    before anything imports ``ray.serve`` (the module doc says why)."""
    for name, value in FAST_INGRESS_ENV.items():
        os.environ.setdefault(name, value)
    pid, *inherited = os.environ.get(PICKED_ENV, "").split() or [""]
    if pid == str(os.getpid()):  # picked already: this process's Ray may listen on them
        return
    picked = [name for name in (*REPLICA_PORT_ENV, *SIDE_PORT_ENV) if name in inherited or name not in os.environ]
    pick_ports(picked)
    os.environ[PICKED_ENV] = " ".join([str(os.getpid()), *picked])


def pick_ports(names: list[str]) -> None:
    """Set each variable of ``names`` (of REPLICA_PORT_ENV, then SIDE_PORT_ENV) to free ports, none inside a range
    picked here, and no range over a port an operator set: a replica of this Serve could take it first."""
    taken = _kept_ports(names)
    for name in names:
        while taken & set(ports := free_port_range(REPLICA_PORTS if name in REPLICA_PORT_ENV else 1)):
            pass
        taken.update(ports)
        os.environ[name] = str(ports[0])
        if name in REPLICA_PORT_ENV:
            os.environ[REPLICA_PORT_ENV[name]] = str(ports[-1] + 1)


def _kept_ports(picking: list[str]) -> set[int]:
    """The ports of the variables already set that are not being picked (an operator's, kept as they are)."""
    kept: set[int] = set()
    for name in (*REPLICA_PORT_ENV, *SIDE_PORT_ENV):
        value = os.environ.get(name, "")
        if name in picking or not value.isdigit():
            continue
        end = os.environ.get(REPLICA_PORT_ENV.get(name, ""), "")
        kept.update(range(int(value), int(end) if name in REPLICA_PORT_ENV and end.isdigit() else int(value) + 1))
    return kept


def side_ports() -> dict[str, int]:
    """The ports of SIDE_PORT_ENV this process's Serve will listen on, by their variable."""
    return {f"${name}": int(os.environ[name]) for name in SIDE_PORT_ENV if name in os.environ}
