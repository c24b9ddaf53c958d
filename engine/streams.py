"""The Ray executor's async side: the deltas of every ``RayEngine.generate`` stream, fetched together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray

from scheduler import EngineRequest, RequestError, RequestOutput, merge_deltas, unpack_outputs


class EngineStopping(RuntimeError):
    """The engine's owner is stopping it: a request still running was ended before it finished."""


class DeltaStreams:
    """The streams of one engine share one channel of its scheduler actor: a single pump fetches each step's
    deltas for all of them in one call and hands them out, where a Ray stream per request would cost one
    object per request per step (a fifth of a core at 64 requests on 2 cores, taken from the ranks).

    Invariants: ``queues`` holds one queue per stream still open, keyed by request id (so an id runs once);
    ``received`` is the last batch the channel got, which the pump's next call acknowledges; a stream that
    ends before its request finished there aborts it.
    """

    def __init__(self, actor, channel: str) -> None:
        self.actor = actor
        self.channel = channel
        self.received = 0
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.pump: asyncio.Task | None = None

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The (checked) request's deltas as they come; leaving early or being cancelled aborts it."""
        request_id = request.request_id
        if request_id in self.queues:  # checked here: its queue would take the running caller's deltas
            raise RequestError("request_id", request_id, "a request with this id is still running")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        remaining = request.sampling_params.n
        try:
            self._ensure_pump()
            finals = await self.actor.add_request.remote(request, self.channel)
            for out in finals:
                remaining -= 1
                yield out
            while remaining:
                deltas = [await queue.get()]
                while not queue.empty():
                    deltas.append(queue.get_nowait())
                for item in deltas:
                    if isinstance(item, BaseException):
                        raise item
                for out in merge_deltas(deltas):
                    remaining -= out.finished
                    yield out
        finally:
            self.queues.pop(request_id, None)
            if remaining:
                self.actor.abort.remote(request_id)

    def end_callers(self, error: BaseException) -> int:
        """End every stream still open by raising ``error`` in it, each aborting its request in the engine
        (and so freeing its KV blocks) as it leaves; returns how many were open."""
        for queue in self.queues.values():
            queue.put_nowait(error)
        return len(self.queues)

    def _ensure_pump(self) -> None:
        loop = asyncio.get_running_loop()
        if self.pump is None or self.pump.done() or self.pump.get_loop() is not loop:
            self.pump = loop.create_task(self._pump_outputs())

    async def _pump_outputs(self) -> None:
        """Hand each batch of the channel's deltas to the streams' queues, for as long as the loop lives; on
        failure every waiting stream gets the exception. Cancelled (its loop closing), it cancels the call it
        waits on in the actor; should that call still return a batch, the next pump's acknowledgement
        (``received``) gets the batch sent again."""
        while True:
            ref = self.actor.get_outputs.remote(self.channel, self.received)
            try:
                self.received, packed = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except Exception as e:  # the actor died or the engine failed: nobody's deltas will come
                self.end_callers(e)
                return
            for out in unpack_outputs(packed):
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
