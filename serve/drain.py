"""A replica's graceful shutdown: stop admitting, let what it holds finish up to a deadline, then end the rest
with an error its clients receive."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ray

from engine.client import EngineStopping
from serve.admission import Admission
from serve.protocol.parsing import APIError

logger = logging.getLogger("ray.serve")
POLL_S = 0.25  # how often the replica looks whether Serve is stopping it, and whether its requests are done
# Serve's force-kill comes this long after the drain deadline (options.py sets graceful_shutdown_timeout_s): time
# for the last error events to be written and the HTTP server to close before the process goes.
MARGIN_S = 5.0
CODE = "replica_shutting_down"


def serve_is_stopping() -> bool:
    """Whether Serve has begun stopping this replica (scale-down, redeploy, delete, shutdown).

    Serve tells user code nothing while it drains a replica: it calls ``__del__`` only after the HTTP server
    has closed, too late to answer anyone. So this reads the flag Serve's replica sets first thing in its
    graceful shutdown (``ReplicaBase._shutting_down``, Ray 2.60, pinned), on the actor instance Ray keeps for
    this process. tests/serve/test_drain.py fails if a Ray upgrade moves it.
    """
    actor_id = ray.get_runtime_context().get_actor_id()
    actor = ray._private.worker.global_worker.actors.get(ray.ActorID.from_hex(actor_id)) if actor_id else None
    return bool(getattr(getattr(actor, "_replica_impl", None), "_shutting_down", False))


class Drain:
    """Graceful shutdown of one replica, run by ``watch`` for the replica's life.

    Once ``is_stopping`` turns true, the admission closes (every new request: 503 ``replica_shutting_down``
    with Retry-After, so the client retries another replica), the requests it holds run on for up to
    ``timeout_s``, and those still running then end with the same 503 (a stream: an error event), which
    aborts them in the engine and frees their KV blocks. The deadline falls ``MARGIN_S`` before Serve's
    force-kill, so no client is cut off without an answer. It happens at most once: a stopping replica
    never serves again.
    """

    def __init__(
        self, admission: Admission, timeout_s: float, is_stopping: Callable[[], bool] = serve_is_stopping
    ) -> None:
        self.admission = admission
        self.timeout_s = timeout_s
        self.is_stopping = is_stopping

    async def watch(self) -> int:
        """Wait for Serve to stop the replica, then drain; returns how many requests the deadline ended."""
        while not self.is_stopping():
            await asyncio.sleep(POLL_S)
        return await self.run()

    async def run(self) -> int:
        """Drain now; returns how many requests the deadline ended."""
        held = self.admission.held
        self.admission.close(
            APIError(
                503,
                "this replica is shutting down and takes no new requests: retry (another replica serves it)",
                code=CODE,
            )
        )
        logger.info("raylm: draining %d requests, for up to drain_timeout_s=%g s", held, self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while self.admission.held and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        ended = (
            self.admission.engine.end_callers(
                EngineStopping(
                    f"this replica is shutting down and the request did not finish within its drain_timeout_s="
                    f"{self.timeout_s:g} s; it was aborted: retry"
                )
            )
            if self.admission.held
            else 0
        )
        logger.info("raylm: drained; %d requests ended at the deadline", ended)
        return ended
