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

from cluster.engine.network import free_port

FAST_INGRESS_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # HAProxy hands the prefix-cache router (router.py) each POST's body, up to its buffer size:
    # 256 KiB holds prompts of tens of thousands of tokens (a longer one is routed by load), where
    # Ray's default (8 MiB) would size every HAProxy buffer for the largest body.
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(256 << 10),
}
# HAProxy also listens on two fixed ports of every interface (its Prometheus metrics, 9101, and stats page,
# 8404), so a second Serve on one host (another `raylm serve --port`, a test session beside a server) failed
# to start its HAProxy; each Ray started here takes free ones instead.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT")


def use_fast_ingress() -> None:
    """Put the settings in this process's environment, unless already set, for Ray and its children. Call it
    before anything imports ``ray.serve`` (the module doc says why)."""
    for name, value in FAST_INGRESS_ENV.items():
        os.environ.setdefault(name, value)
    for name in HAPROXY_PORT_ENV:
        if name not in os.environ:
            os.environ[name] = str(free_port())
