"""The scheduler actor: one Scheduler, the worker handles, and the engine loop that steps them.

Runs on a CPU head node, so it imports only the standard library, ray and scheduler/ (never
torch, never the rest of cluster/). engine/ray_client.py places it and the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import ray

from cluster.worker_actor import LORA_READS
from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    RequestError,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
    pack_outputs,
)

# New prompt tokens above which a step is ray.put once and the ref sent to every rank. Below that a
# step pickles under Ray's 100 KiB inline limit and travels by value inside each call, which measured
# 1.1 ms vs 2.3 ms per empty-step round trip at tp=1 (1.6 vs 3.2 ms at tp=2): a put is a plasma
# round trip. Above it Ray would put the argument once per rank, so one explicit put is cheaper.
PUT_PROMPT_TOKENS = 32768


@dataclass(slots=True)
class _Stream:
    """Where one caller's deltas go: its channel's outbox, fetched in batches by ``get_outputs`` (one call
    per step for all of a process's requests, where a Ray stream per request would cost one object per
    request per step).

    ``num_unfinished`` counts its samples (``n``) still running; the stream is
    dropped when it reaches 0, so a delta for an unknown id belongs to a caller
    that aborted and is discarded.
    """

    channel: str
    num_unfinished: int


@dataclass(slots=True)
class _Outbox:
    """One channel's deltas on their way to its caller, kept until the caller acknowledges them.

    ``pending`` are deltas not yet sent; ``unacked`` is batch ``number``, sent
    but not yet acknowledged. A caller passes the number of the last batch it
    received, so a batch whose call was lost (a cancelled caller whose cancel
    came after the call had taken the batch) is sent again, never dropped,
    and a batch the caller has is never sent twice.
    """

    pending: list[RequestOutput] = field(default_factory=list)
    unacked: list[RequestOutput] = field(default_factory=list)
    number: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self, received: int) -> tuple[int, list[RequestOutput]] | None:
        """The next batch for a caller holding batch ``received`` (None: nothing to send yet)."""
        if received == self.number:
            self.unacked = []
        if not self.pending and not self.unacked:
            return None
        self.unacked, self.pending = self.unacked + self.pending, []
        self.number += 1
        return self.number, self.unacked


def execute_step(workers: list, scheduler_output: SchedulerOutput) -> asyncio.Future[list[ModelRunnerOutput | None]]:
    """Send one step to every rank (the same serialized step) and gather their replies; the driver's is the output.

    Awaiting all ranks, not just rank 0, surfaces a dead rank at once instead of leaving rank 0 in a
    collective, and keeps every rank's queue at most two steps deep (one with async scheduling off).
    Plain actor calls, not a Ray compiled graph: a graph cuts the empty-step round trip (0.7 vs 1.1 ms
    at tp=1, 0.9 vs 1.6 ms at tp=2) but its channels busy-poll, and the waiting loop burns 0.7-1.0 of a
    core that a CPU node's ranks need for torch (cluster/bench/ray_overhead.py).
    """
    arg = scheduler_output
    new_prompt_tokens = sum(len(r.prompt_token_ids) for r in scheduler_output.scheduled_new_reqs)
    if len(workers) > 1 and new_prompt_tokens > PUT_PROMPT_TOKENS:
        arg = ray.put(scheduler_output)
    return asyncio.gather(*[w.execute_model.remote(arg) for w in workers])


def _retrieve(future: asyncio.Future) -> None:
    """Take a dropped step's outcome (a cancelled gather ends with a CancelledError as its exception), so that
    asyncio never reports an exception nobody retrieved."""
    if not future.cancelled():
        future.exception()


class SchedulerActor:
    """Owns the Scheduler and runs schedule → execute on every rank → update in a background task.

    Invariants:
    - only the loop task calls ``schedule``/``update_from_output``; requests are
      added and aborted between awaits, which the Scheduler allows mid-step (an
      aborted request's late token is dropped);
    - with ``async_scheduling`` (vLLM's name) two steps are in flight: step N+1
      is scheduled and sent before step N's replies are awaited, so the ranks
      always have the next step queued and the scheduler's work and the Ray
      round trip leave the critical path. Steps are applied in order, step N's
      before step N+2 is scheduled (the Scheduler's placeholder invariants rest
      on it). With P pipeline stages, P steps are in flight (vLLM's batch
      queue), one per stage, and step N's output is applied before step N+P is
      scheduled; the Scheduler then keeps each sampling request in one of them.
      Without it, one step is in flight (the serial loop);
    - every live caller id has exactly one ``_Stream``; each delta reaches its
      caller once, and deltas of step N are routed while the workers compute
      the steps after it (the loop's bookkeeping overlaps their compute);
    - the loop sleeps on ``wake`` when nothing can run and no step is in
      flight, never spins: after an empty plan it schedules again only once a
      step's output was applied or a request arrived;
    - once ``error`` is set (a step failed: a rank died or raised, or the
      ranks did not all reply within ``step_timeout_s``: one is hung) every
      live request has had an "error" delta and no new request is taken,
      because the ranks' states may disagree and a collective could hang.
    """

    def __init__(self, workers: list, eos_token_id: int | None) -> None:
        # The Scheduler waits for start(): its size is known only once every rank has sized its cache,
        # and creating the actor first lets its process boot while the ranks load the model.
        self.scheduler: Scheduler | None = None
        self.workers = workers
        self.eos_token_id = eos_token_id
        self.streams: dict[str, _Stream] = {}
        self.outboxes: dict[str, _Outbox] = defaultdict(_Outbox)
        self.wake = asyncio.Event()
        self.error: str | None = None
        self.loop_task: asyncio.Task | None = None
        self.step_timeout_s: float | None = None
        self.driver = 0  # the index of the rank whose reply carries the sampled tokens
        self.depth = 2  # steps in flight at most
        self.lora_names: set[str] = set()  # the LoRA adapters every rank holds

    async def start(
        self,
        config: SchedulerConfig,
        step_timeout_s: float | None = None,
        lora_names: tuple[str, ...] = (),
    ) -> None:
        if self.loop_task is None:
            self.lora_names = set(lora_names)
            self.step_timeout_s = step_timeout_s
            self.scheduler = Scheduler(config, eos_token_id=self.eos_token_id)
            pp = config.pipeline_parallel_size
            self.driver = len(self.workers) - len(self.workers) // pp  # the last stage's first rank samples
            self.depth = config.steps_in_flight
            self.loop_task = asyncio.create_task(self._run())

    # ---- the engine loop ----------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:  # a dead or failing rank: no request can go on
            # The callers hear the reason in one line; the actor's log keeps where it was raised.
            logging.getLogger(__name__).exception("engine step failed")
            self._fail(f"engine step failed: {type(e).__name__}: {e}")

    async def _loop(self) -> None:
        scheduler = self.scheduler
        depth = self.depth
        in_flight: deque[tuple[SchedulerOutput, asyncio.Future]] = deque()
        outputs: list[RequestOutput] = []
        idle = True
        try:
            while True:
                if not in_flight and (idle or not scheduler.has_unfinished_requests()):
                    self._route(outputs)
                    outputs = []
                    await self.wake.wait()
                # After an empty plan nothing more can run until a step in flight returns.
                if not in_flight or not in_flight[-1][0].is_empty:
                    self.wake.clear()  # before scheduling: a request arriving after it wakes the next sleep
                    scheduler_output = scheduler.schedule()
                    in_flight.append((scheduler_output, execute_step(self.workers, scheduler_output)))
                    # An empty plan with requests left: none can run until something arrives or leaves.
                    idle = scheduler_output.is_empty
                    if len(in_flight) < depth and not scheduler_output.is_empty:
                        continue
                self._route(outputs)
                done, replies = in_flight.popleft()
                outputs = scheduler.update_from_output(done, (await self._replies(replies, done.step_id))[self.driver])
                if not done.is_empty:
                    idle = False  # its tokens, finishes and freed blocks may let the next plan run something
        finally:
            for _, replies in in_flight:  # a failed loop's other step: cancelled, and its outcome retrieved
                replies.cancel()
                replies.add_done_callback(_retrieve)

    async def _replies(self, replies: asyncio.Future, step_id: int) -> list[ModelRunnerOutput | None]:
        try:
            return await asyncio.wait_for(replies, self.step_timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"step {step_id} got no reply from every rank within step_timeout_s="
                f"{self.step_timeout_s:g} s: a rank is hung (or the step is slower than the "
                f"timeout allows)"
            ) from None

    def _route(self, outputs: list[RequestOutput]) -> None:
        streams = self.streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            self.outboxes[stream.channel].pending.append(out)
            if out.finished:
                stream.num_unfinished -= 1
                if not stream.num_unfinished:
                    del streams[out.request_id]
        for outbox in self.outboxes.values():
            if outbox.pending:
                outbox.ready.set()

    def _fail(self, error: str) -> None:
        self.error = error
        self._route(self.scheduler.fail_all(error))
        for outbox in self.outboxes.values():
            outbox.ready.set()  # a waiting get_outputs must wake to raise

    # ---- requests in and out ------------------------------------------------------

    async def add_request(self, request: EngineRequest, channel: str = "sync") -> list[RequestOutput]:
        """Queue a (checked) request whose deltas go to ``channel``'s outbox (``get_outputs``); returns any
        immediate finals. Its adapter must be loaded (it waits for a slot, never for a load)."""
        if self.error is not None:
            raise RuntimeError(f"the engine is unhealthy and takes no new requests: {self.error}")
        lora_name = request.lora_name
        if lora_name is not None and lora_name not in self.lora_names:
            raise RequestError(
                "model", lora_name, f"no LoRA adapter of this name is loaded (loaded: {sorted(self.lora_names)})"
            )
        finals = self.scheduler.add_request(dataclasses.replace(request, arrival_time=time.monotonic()))
        n = request.sampling_params.n
        if len(finals) < n:
            self.streams[request.request_id] = _Stream(channel, n - len(finals))
            self.wake.set()
        return finals

    # ---- LoRA adapters at run time ---------------------------------------------------

    async def add_lora(self, name: str, path: str) -> None:
        """Every rank reads adapter `name` into host memory, or none keeps it: a ValueError naming the adapter and
        the mismatch. The ranks read it on their LORA_READS thread while steps go on; no step names it before every
        rank has it."""
        if name in self.lora_names:
            raise ValueError(f"LoRA adapter {name!r}: an adapter of this name is already loaded")
        results = await asyncio.gather(
            *[w.call.options(concurrency_group=LORA_READS).remote("add_lora", name, path) for w in self.workers],
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*[w.call.remote("remove_lora", name) for w in self.workers], return_exceptions=True)
            cause = getattr(failed[0], "cause", None) or failed[0]  # a rank's ValueError inside Ray's error
            raise ValueError(str(cause).strip().splitlines()[-1].removeprefix("ValueError: ")) from None
        self.lora_names.add(name)

    async def remove_lora(self, name: str) -> None:
        """Unload adapter `name`: a ValueError naming it when it is absent or a live request still runs with it.
        A step already sent that used it runs before the ranks take the call."""
        if name not in self.lora_names:
            raise ValueError(f"LoRA adapter {name!r}: no adapter of this name is loaded")
        if self.scheduler.lora_in_use(name):
            raise ValueError(f"LoRA adapter {name!r}: requests running with it have not finished")
        self.lora_names.discard(name)
        await asyncio.gather(*[w.call.remote("remove_lora", name) for w in self.workers])

    async def list_loras(self) -> list[str]:
        return sorted(self.lora_names)

    async def get_outputs(self, channel: str = "sync", received: int = 0) -> tuple[int, list[tuple]]:
        """The channel's next batch of deltas (packed: ``unpack_outputs`` gives the RequestOutputs) and its number,
        waiting until there is one. ``received`` is the number of the last batch the caller got (0 at first):
        until then that batch is kept and sent again."""
        outbox = self.outboxes[channel]
        while (batch := outbox.take(received)) is None:
            if self.error is not None:
                raise RuntimeError(f"the engine is unhealthy: {self.error}")
            outbox.ready.clear()
            await outbox.ready.wait()
        number, outputs = batch
        return number, pack_outputs(outputs)

    async def abort(self, request_id: str) -> list[RequestOutput]:
        return self._abort(request_id)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        finals = self.scheduler.abort(request_id)
        self.streams.pop(request_id, None)
        return finals

    # ---- observability --------------------------------------------------------------

    async def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    async def routing_digest(self, limit: int) -> tuple[list[bytes], int]:
        """The prefix cache's block hashes (at most ``limit``) and the requests it holds (running and waiting)."""
        return self.scheduler.cached_block_hashes(limit), len(self.scheduler.requests)

    async def check_health(self, timeout_s: float = 10.0) -> None:
        """Raise RuntimeError when the engine cannot serve. An idle loop sends no steps, so ask the ranks."""
        if self.error is None and not self.scheduler.has_unfinished_requests():
            try:
                await asyncio.wait_for(asyncio.gather(*[w.check_health.remote() for w in self.workers]), timeout_s)
            except Exception as e:
                self._fail(f"health check failed: {type(e).__name__}: {e}")
        if self.error is not None:
            raise RuntimeError(f"the engine is unhealthy: {self.error}")
