"""The engine core: one Scheduler, the step loop, the request's admission, the loaded adapters' names and the
routing of deltas to their callers, behind no transport. The scheduler actor wraps it for Ray (its ranks'
fan-out as ``execute``); the in-process engine runs it directly (its worker as ``execute``).

Runs on the scheduler actor's CPU head too, so it imports only the standard library and scheduler/ (never
torch, never ray).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    RequestError,
    RequestOutput,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler.kv_events import KVEvent

T = TypeVar("T")

Execute = Callable[[SchedulerOutput], Awaitable[ModelRunnerOutput | None]]

# How a core whose caller steps it (the in-process engine) waits until a condition holds: by stepping it. None: the
# core's loop runs in the background (the scheduler actor's), and waiting is for the loop to park.
Until = Callable[[Callable[[], bool]], Awaitable[None]]

# pause_generation's modes, as vLLM names them: end every live request, let them finish, or freeze them.
PAUSE_MODES = ("abort", "wait", "keep")

# Where each step's KV-cache events go (engine/kv_events.py's publisher): it must never block.
PublishEvents = Callable[[list[KVEvent]], None]


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


def _finals(request: EngineRequest, error: str | None = None) -> list[RequestOutput]:
    """The final deltas of a held request that ends before it reached the Scheduler: aborted, or failed with
    ``error``."""
    return [
        RequestOutput(
            request_id=request.request_id,
            index=i,
            new_token_ids=[],
            finished=True,
            finish_reason="abort" if error is None else "error",
            num_prompt_tokens=len(request.prompt_token_ids),
            error=error,
        )
        for i in range(request.sampling_params.n)
    ]


def retrieve(future: asyncio.Future) -> None:
    """Take a dropped step's outcome (a cancelled gather ends with a CancelledError as its exception), so that
    asyncio never reports an exception nobody retrieved."""
    if not future.cancelled():
        future.exception()


class EngineCore:
    """The Scheduler and its step loop: schedule → ``execute`` → update, with up to ``depth`` steps in flight.

    Invariants:
    - only ``run`` calls ``schedule``/``update_from_output``; requests are
      added and aborted between awaits, which the Scheduler allows mid-step (an
      aborted request's late token is dropped);
    - with ``depth`` > 1 (async scheduling, vLLM's name) step N+1 is scheduled
      and sent before step N's output is awaited, so the ranks always have the
      next step queued and the scheduler's work and the transport's round trip
      leave the critical path. Steps are applied in order, step N's before step
      N+depth is scheduled (the Scheduler's placeholder invariants rest on it);
      with P pipeline stages depth is P (vLLM's batch queue), and the Scheduler
      keeps each sampling request in one of them. ``execute`` sends a step when
      called; what it returns is awaited for the step's output;
    - every live caller id has exactly one ``_Stream``; each delta reaches its
      caller once, and deltas of step N are routed while the ranks compute the
      steps after it (the loop's bookkeeping overlaps their compute);
    - the loop sleeps on ``wake`` when nothing can run and no step is in
      flight, never spins: after an empty plan it schedules again only once a
      step's output was applied or a request arrived;
    - ``lora_names`` are the adapters every rank holds; a request naming
      another is refused before it is scheduled;
    - with ``publish_kv_events``, the KV-cache events of each applied step (its
      caching, and the evictions of the plans scheduled since the last one)
      go to it as one batch, right after the step is applied;
    - once ``error`` is set (``stop``: a step failed, a rank died or hung)
      every live request has had an "error" delta and no new request is taken,
      because the ranks' states may disagree and a collective could hang;
    - the gate (RL rollouts, issue #71): while ``stopped`` (asleep, paused, or
      an ``exclusive`` operation running) no step is scheduled; the steps in
      flight are still applied. While ``holding`` (the same, and a pause in
      "wait" mode still draining) a new request is checked, stamped and kept in
      ``held``, in arrival order, and goes to the Scheduler once the gate opens:
      served, never lost. A weight update or sleep runs only once no step is in
      flight (``exclusive``), since a step would read weights or KV changing
      under it; after an update the prefix cache is forgotten unless asked not
      to (its KV came from the old weights), and after sleep always (the KV
      tensors are freed). ``weight_version`` names the weights served.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        execute: Execute,
        *,
        depth: int = 1,
        step_timeout_s: float | None = None,
        lora_names: tuple[str, ...] = (),
        publish_kv_events: PublishEvents | None = None,
        until: Until | None = None,
        reopened: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.execute = execute
        self.depth = depth
        self.step_timeout_s = step_timeout_s
        self.lora_names = set(lora_names)
        self.publish_kv_events = publish_kv_events
        self.streams: dict[str, _Stream] = {}
        self.outboxes: dict[str, _Outbox] = defaultdict(_Outbox)
        self.wake = asyncio.Event()
        self.error: str | None = None
        # Sent and not yet applied, oldest first; kept across ``run`` calls (the in-process engine's ``step``
        # returns with the next step still in flight).
        self.in_flight: deque[tuple[SchedulerOutput, asyncio.Future]] = deque()
        self.until = until or self._parked_until
        # Called once the gate opened, for a core its caller steps (the caller steps again); the background loop
        # wakes on ``wake`` instead.
        self.reopened = reopened
        self.parked = asyncio.Event()  # set when the background loop parks with no step in flight
        self.asleep = False  # the ranks released their KV (and maybe weights): nothing can run
        self.paused = False  # pause_generation ran, resume_generation has not
        self.draining = False  # pausing in "wait" mode: what is live runs on until none is
        self.in_exclusive = False  # an operation that must see no step in flight runs (``exclusive``)
        self.exclusive_lock = asyncio.Lock()  # one at a time: ranks must take a broadcast's calls in one order
        self.held: dict[str, tuple[EngineRequest, str]] = {}  # by request id, in arrival order, with its channel
        self.weight_version = "default"

    # ---- the step loop --------------------------------------------------------------

    async def run(self, max_steps: int | None = None) -> None:
        """Step for as long as there are requests, sleeping while there are none: forever (the actor's task), or
        until ``max_steps`` steps are applied (the in-process engine's ``step``), returning where it would sleep or
        with up to ``depth`` - 1 steps still in flight, which the next call goes on with."""
        scheduler = self.scheduler
        in_flight = self.in_flight
        outputs: list[RequestOutput] = []
        idle = max_steps is None
        applied = 0
        try:
            while max_steps is None or applied < max_steps:
                if not in_flight and (idle or self.stopped or not scheduler.has_unfinished_requests()):
                    self._route(outputs)
                    outputs = []
                    if max_steps is not None:
                        return
                    self.parked.set()
                    await self.wake.wait()
                    if self.stopped:
                        self.wake.clear()  # nothing may run: whatever opens the gate sets it again
                        continue
                # After an empty plan nothing more can run until a step in flight returns.
                if not self.stopped and (not in_flight or not in_flight[-1][0].is_empty):
                    self.wake.clear()  # before scheduling: a request arriving after it wakes the next sleep
                    scheduler_output = scheduler.schedule()
                    in_flight.append((scheduler_output, asyncio.ensure_future(self.execute(scheduler_output))))
                    # An empty plan with requests left: none can run until something arrives or leaves.
                    idle = scheduler_output.is_empty
                    if len(in_flight) < self.depth and not scheduler_output.is_empty:
                        continue
                self._route(outputs)
                done, output = in_flight[0]  # in flight until applied: ``until`` waits for that
                runner_output = await self._output(output, done.step_id)
                in_flight.popleft()
                outputs = scheduler.update_from_output(done, runner_output)
                if self.publish_kv_events is not None:
                    self.publish_kv_events(scheduler.kv.take_events())
                applied += 1
                if not done.is_empty:
                    idle = False  # its tokens, finishes and freed blocks may let the next plan run something
            self._route(outputs)
        except BaseException:
            self.drop_in_flight()
            self.parked.set()  # nothing is in flight now: a waiting ``until`` looks again
            raise

    def drop_in_flight(self) -> None:
        """Cancel the steps in flight (a failed loop's others, or an engine shutting down), their outcomes
        retrieved."""
        for _, output in self.in_flight:
            output.cancel()
            output.add_done_callback(retrieve)
        self.in_flight.clear()

    async def _output(self, output: asyncio.Future, step_id: int) -> ModelRunnerOutput | None:
        try:
            return await asyncio.wait_for(output, self.step_timeout_s)
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

    def fail_all(self, error: str) -> None:
        """End every live request, held ones too, with an "error" delta naming ``error``."""
        held, self.held = self.held, {}
        self._route([*self.scheduler.fail_all(error), *(o for r, _ in held.values() for o in _finals(r, error))])

    def stop(self, error: str) -> None:
        """Fail every live request and take no new one (the ranks may disagree: see the class's invariants)."""
        self.error = error
        self.fail_all(error)
        for outbox in self.outboxes.values():
            outbox.ready.set()  # a waiting get_outputs must wake to raise

    # ---- requests in and out ------------------------------------------------------

    def add_request(self, request: EngineRequest, channel: str) -> list[RequestOutput]:
        """Queue a (checked) request whose deltas go to ``channel``'s outbox (``get_outputs``); returns any
        immediate finals. Its adapter must be loaded (it waits for a slot, never for a load)."""
        if self.error is not None:
            raise RuntimeError(f"the engine is unhealthy and takes no new requests: {self.error}")
        lora_name = request.lora_name
        if lora_name is not None and lora_name not in self.lora_names:
            raise RequestError(
                "model", lora_name, f"no LoRA adapter of this name is loaded (loaded: {sorted(self.lora_names)})"
            )
        # Stamped here, on the scheduler's clock: the caller's may be another process's.
        request = dataclasses.replace(request, arrival_time=time.monotonic())
        n = request.sampling_params.n
        if self.holding:
            self.scheduler.check_request(request, self.held)  # so that taking it once the gate opens cannot fail
            self.held[request.request_id] = (request, channel)
            self.streams[request.request_id] = _Stream(channel, n)
            return []
        finals = self.scheduler.add_request(request)
        if len(finals) < n:
            self.streams[request.request_id] = _Stream(channel, n - len(finals))
            self.wake.set()
        return finals

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End the request wherever it is (held, waiting, running) and return its final deltas: the caller hands
        them to its stream."""
        finals = self._end(request_id)
        self.streams.pop(request_id, None)
        return finals

    def _end(self, request_id: str) -> list[RequestOutput]:
        """The aborted request's final deltas, its stream left to whoever routes them."""
        held = self.held.pop(request_id, None)
        return self.scheduler.abort(request_id) if held is None else _finals(held[0])

    def waits_with_staged_kv(self, request_id: str) -> bool:
        """Whether the request waits, held or in the Scheduler, with KV its ranks staged (Scheduler's namesake)."""
        held = self.held.get(request_id)
        return self.scheduler.waits_with_staged_kv(request_id) or (held is not None and held[0].kv_transfer is not None)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.num_waiting += len(self.held)
        stats.weight_version = self.weight_version
        return stats

    async def get_outputs(self, channel: str, received: int) -> tuple[int, list[RequestOutput]]:
        """The channel's next batch of deltas and its number, waiting until there is one. ``received`` is the
        number of the last batch the caller got (0 at first): until then that batch is kept and sent again."""
        outbox = self.outboxes[channel]
        while (batch := outbox.take(received)) is None:
            if self.error is not None:
                raise RuntimeError(f"the engine is unhealthy: {self.error}")
            outbox.ready.clear()
            await outbox.ready.wait()
        return batch

    def take_outputs(self, channel: str) -> list[RequestOutput]:
        """What the channel holds now, acknowledged at once (a caller in this process cannot lose a batch)."""
        outbox = self.outboxes[channel]
        batch = outbox.take(outbox.number)
        return [] if batch is None else batch[1]

    # ---- LoRA adapters ----------------------------------------------------------------

    def check_new_adapter(self, name: str) -> None:
        if name in self.lora_names:
            raise ValueError(f"LoRA adapter {name!r}: an adapter of this name is already loaded")

    def release_adapter(self, name: str) -> None:
        """Forget adapter ``name`` before its ranks unload it: a ValueError naming it when it is absent or a live
        request still runs with it."""
        if name not in self.lora_names:
            raise ValueError(f"LoRA adapter {name!r}: no adapter of this name is loaded")
        if self.scheduler.lora_in_use(name):
            raise ValueError(f"LoRA adapter {name!r}: requests running with it have not finished")
        self.lora_names.discard(name)

    # ---- the gate: pause, sleep, weight updates (RL rollouts) ---------------------------

    @property
    def stopped(self) -> bool:
        """No step may be scheduled now (the steps in flight are still applied)."""
        return self.asleep or self.in_exclusive or (self.paused and not self.draining)

    @property
    def holding(self) -> bool:
        """New requests wait in ``held`` rather than in the Scheduler."""
        return self.asleep or self.in_exclusive or self.paused

    def has_unfinished_requests(self) -> bool:
        """Live requests, held ones too."""
        return bool(self.held) or self.scheduler.has_unfinished_requests()

    def wants_step(self) -> bool:
        """Whether stepping the core would do anything: a step to apply, or live requests and an open gate."""
        return bool(self.in_flight) or (not self.stopped and self.scheduler.has_unfinished_requests())

    async def _parked_until(self, done: Callable[[], bool]) -> None:
        # The background loop parks (setting ``parked``) whenever it has no step in flight and cannot schedule one.
        while not done():
            self.parked.clear()
            await self.parked.wait()

    def _reopen(self) -> None:
        """After the gate changed: once nothing holds requests back, the held ones go to the Scheduler in arrival
        order (its finals to their streams); the loop looks again."""
        if not self.holding:
            held, self.held = self.held, {}
            for request, _ in held.values():
                self._route(self.scheduler.add_request(request))
        self.wake.set()
        if self.reopened is not None:
            self.reopened()

    async def pause_generation(self, mode: str = "abort") -> int:
        """Schedule nothing until ``resume_generation``, and return once no step is in flight. "abort": every live
        request (held ones too) ends now with finish_reason "abort", routed to its caller; returns how many.
        "wait": the live ones run to the end, new ones are held; returns once none is live. "keep": the live ones
        are frozen where they are (the steps in flight applied first) and go on after the resume."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: choose one of {', '.join(PAUSE_MODES)}")
        self.paused = True
        self.draining = mode == "wait"
        aborted = [*self.scheduler.children, *self.held] if mode == "abort" else []
        for request_id in aborted:
            self._route(self._end(request_id))
        try:
            drained = (lambda: not self.scheduler.has_unfinished_requests()) if self.draining else (lambda: True)
            await self.until(lambda: not self.in_flight and (not self.paused or drained()))
        finally:
            self.draining = False
        return len(aborted)

    def resume_generation(self) -> None:
        self.paused = False
        self.draining = False
        self._reopen()

    async def exclusive(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` (a weight update, sleep, wake-up) once no step is in flight, scheduling none until it
        returns: the ranks must not run a step while their weights or KV change. Requests arriving meanwhile are
        held. One at a time, so that every rank takes the calls of concurrent operations in one order."""
        async with self.exclusive_lock:
            self.in_exclusive = True
            try:
                await self.until(lambda: not self.in_flight)
                if self.error is not None:
                    raise RuntimeError(f"the engine is unhealthy: {self.error}")
                return await work()
            finally:
                self.in_exclusive = False
                self._reopen()

    async def update_weights(
        self, update: Callable[[], Awaitable[object]], flush_cache: bool, weight_version: str | None
    ) -> None:
        """Run ``update`` (every rank's) exclusively; once it succeeded, forget the prefix cache (unless
        ``flush_cache`` is False: the caller knows the KV still holds) and name the new weights. A refused update
        (the ranks' ValueError) changes neither."""

        async def run() -> None:
            await update()
            if flush_cache:
                self.scheduler.reset_prefix_cache()
            if weight_version is not None:
                self.weight_version = weight_version

        await self.exclusive(run)

    async def sleep(self, release: Callable[[], Awaitable[object]]) -> None:
        """Release the ranks' memory (``release``: every rank's Worker.sleep) exclusively; a ValueError naming how
        many requests are live, since their KV would go with it. The prefix cache is forgotten: its KV is gone."""

        async def run() -> None:
            live = len(self.scheduler.children)
            if live:
                raise ValueError(
                    f"cannot sleep with {live} live request(s) (running, waiting or paused with mode 'keep'): "
                    f"pause_generation(mode='abort') ends them, or let them finish first"
                )
            await release()
            self.scheduler.reset_prefix_cache()
            self.asleep = True

        await self.exclusive(run)

    async def wake_up(self, restore: Callable[[], Awaitable[bool]]) -> None:
        """Give the ranks their memory back exclusively; ``restore`` (every rank's Worker.wake_up) says whether
        anything still sleeps. Once nothing does, the held requests are taken."""

        async def run() -> None:
            self.asleep = await restore()

        await self.exclusive(run)
