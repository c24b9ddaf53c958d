"""Admission: how many generation requests one replica holds at once, and the refusal past that."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from scheduler import EngineRequest, RequestOutput
from serve.protocol.parsing import APIError


class Admission:
    """The replica's door to its engine: at most ``capacity`` requests held (the engine's ``max_num_seqs``
    running plus ``max_queue_len`` waiting in its queue); one more is refused at once with a 429.

    Why here and not in Serve's queue: Serve sends a replica up to ``max_ongoing_requests`` and queues the
    rest without bound (a flood becomes minutes of time-to-first-token for everyone), while its own
    ``max_queued_requests`` answers with a plain-text body. Queued in the engine instead, waiting requests
    show in ``vllm:num_requests_waiting`` and the priority policy orders them.

    Invariant: ``held`` counts the engine streams opened through ``generate`` and not yet closed; each
    refusal is counted once in ``on_reject``. Once ``close``d (the replica is draining) it refuses every new
    request with the error it was given, and never opens again.
    """

    def __init__(self, engine: Any, capacity: int, on_reject: Any) -> None:
        self.engine = engine
        self.capacity = capacity
        self.on_reject = on_reject
        self.held = 0
        self.closed: APIError | None = None

    def close(self, error: APIError) -> None:
        """Refuse every request from now on with ``error``; the ones held run on."""
        self.closed = error

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The engine's stream, or a 429 raised before any stream exists (not an async generator on purpose:
        the refusal must come from the call, not from the first delta)."""
        if self.closed is not None:
            raise self.closed
        if self.held >= self.capacity:
            self.on_reject()
            raise APIError(
                429,
                f"this replica holds {self.held} requests, its limit (max_num_seqs running plus "
                f"max_queue_len waiting): retry later",
                code="queue_full",
            )
        stream = self.engine.generate(request)  # checks it
        self.held += 1
        return self._held(stream)

    async def _held(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                yield out
        finally:
            self.held -= 1
            await stream.aclose()
