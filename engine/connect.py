"""Joining a Ray cluster, or starting a local Ray that can hold an engine."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator

import ray

# What a local Ray's daemons poll at rates a single-machine `raylm serve` does not need; every Ray process reads
# these from the environment it starts with. Idle, they took a tenth of a 2-core machine (docs/serving.md).
LOCAL_RAY_ENV = {
    # Serve's controller runs its loop every 0.1 s by default, at ~5 ms of CPU each: the most expensive idle
    # process. Health checks come every health_check_period_s (10 s) and autoscaling waits upscale_delay_s (30 s),
    # so half a second changes nothing a user sees but a deployment's start by a few loops.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # The dashboard agent's reporter lists every process's CPU and memory (psutil) each 5 s for the dashboard,
    # which a local Ray here does not start. raylm's /metrics come from the metrics export, which this leaves be.
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
}


def connect(address: str | None, min_cpus: float, timeout_s: float = 60.0) -> None:
    """Join the cluster at ``address`` (or $RAY_ADDRESS), else start a local Ray that can hold the engine. A head
    that does not answer within ``timeout_s`` is an error naming the address."""
    if ray.is_initialized():
        return
    if not starts_local_ray(address):
        check_head_answers(address or os.environ["RAY_ADDRESS"], timeout_s)
        ray.init(address=address)
        return
    # Ray starts its workers at nice 15, below its own daemons and every other process on the node. A rank's
    # torch threads are the engine's critical path: at nice 15 any nice-0 process (a load generator, a build)
    # takes their cores at once, and the other threads wait for the preempted one at the next barrier.
    os.environ.setdefault("RAY_worker_niceness", "0")
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    # Ray turns token authentication on for a new local cluster and warns on every start that it did, telling the
    # user how to opt out. (Naming the mode in RAY_AUTH_MODE instead would skip the refresh of the config Ray
    # cached at import, and this process would then be refused by its own GCS.)
    with without_log_lines("ray._private.authentication.authentication_token_setup", "Token authentication is enabled"):
        # Logical CPUs only count reservations; the engine sets thread counts from the real cores.
        ray.init(num_cpus=max(os.cpu_count() or 1, int(min_cpus + 0.999)), include_dashboard=False)


@contextlib.contextmanager
def without_log_lines(logger_name: str, prefix: str) -> Iterator[None]:
    """Drop, meanwhile, the records of logger ``logger_name`` whose message starts with ``prefix``: a library's line
    that would ask the user to act where nothing is wrong."""

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefix)

    logger = logging.getLogger(logger_name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def starts_local_ray(address: str | None) -> bool:
    """Whether `connect(address, ...)` starts a Ray of its own (no address given, none in $RAY_ADDRESS)."""
    return address is None and "RAY_ADDRESS" not in os.environ


def check_head_answers(address: str, timeout_s: float) -> None:
    """Raise RuntimeError unless the head's GCS at ``address`` (HOST:PORT) accepts a connection within
    ``timeout_s``: ray.init would retry an unreachable or wrong address silently for minutes. Other forms
    ("auto", ray://...) are left to Ray."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"no Ray head answers at {address} within placement_timeout_s={timeout_s:g} ({e}): check the "
                    f"address (`ray start --head` prints it; the port is 6379 unless --port says otherwise) and "
                    f"that this machine reaches that host and port"
                ) from None
            time.sleep(0.5)
