"""The scheduler actor: the engine core (engine/core.py) on Ray, stepping its worker actors.

Runs on a CPU head node, so it imports only the standard library, ray, scheduler/, the engine core and its KV-event
publisher (pyzmq, msgpack), never torch. engine/ray_client.py places it and the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import ray

from engine.controls import EngineControls
from engine.core import EngineCore, retrieve
from engine.kv_events import KVEventPublisher
from engine.worker_actor import KV_TRANSFERS, LORA_READS
from scheduler import (
    EngineRequest,
    KVTransferError,
    ModelRunnerOutput,
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


def execute_step(workers: list, scheduler_output: SchedulerOutput) -> asyncio.Future[list[ModelRunnerOutput | None]]:
    """Send one step to every rank (the same serialized step) and gather their replies; the driver's is the output.

    Awaiting all ranks, not just rank 0, surfaces a dead rank at once instead of leaving rank 0 in a
    collective, and keeps every rank's queue at most two steps deep (one with async scheduling off).
    Plain actor calls, not a Ray compiled graph: a graph cuts the empty-step round trip (0.7 vs 1.1 ms
    at tp=1, 0.9 vs 1.6 ms at tp=2) but its channels busy-poll, and the waiting loop burns 0.7-1.0 of a
    core that a CPU node's ranks need for torch (bench/ray_overhead.py).
    """
    arg = scheduler_output
    new_prompt_tokens = sum(len(r.prompt_token_ids) for r in scheduler_output.scheduled_new_reqs)
    if len(workers) > 1 and new_prompt_tokens > PUT_PROMPT_TOKENS:
        arg = ray.put(scheduler_output)
    replies = asyncio.gather(*[w.execute_model.remote(arg) for w in workers])
    replies.add_done_callback(retrieve)  # also when the step is dropped before anyone awaits it
    return replies


class SchedulerActor(EngineControls):
    """The engine core behind Ray: its step loop runs as a background task, each step sent to every rank.

    Invariants: the core exists once ``start`` ran (the Scheduler's size is known only once every rank has
    sized its cache, and creating the actor first lets its process boot while the ranks load the model); a
    failed loop (a rank died or raised, or the ranks did not all reply within ``step_timeout_s``) stops the
    core, which then fails every live request and takes no new one; an adapter is in ``core.lora_names``
    only while every rank holds it. The RL controls (engine/controls.py) reach the ranks through ``on_ranks``;
    no tensor is ever unpickled here (this process has no torch): weights travel as ObjectRefs the ranks fetch.
    """

    def __init__(self, workers: list, eos_token_id: int | None) -> None:
        self.workers = workers
        self.eos_token_id = eos_token_id
        self.core: EngineCore | None = None
        self.loop_task: asyncio.Task | None = None
        self.driver = 0  # the index of the rank whose reply carries the sampled tokens
        self.kv_transfers = [0, 0, 0.0]  # requests whose KV every rank fetched, bytes, seconds (SchedulerStats)

    async def start(
        self,
        config: SchedulerConfig,
        step_timeout_s: float | None = None,
        lora_names: tuple[str, ...] = (),
        kv_events: dict | None = None,
    ) -> None:
        """Build the core and start its loop; ``kv_events``: EngineConfig.kv_events, the publisher's settings."""
        if self.loop_task is None:
            pp = config.pipeline_parallel_size
            self.driver = len(self.workers) - len(self.workers) // pp  # the last stage's first rank samples
            publisher = None if kv_events is None else KVEventPublisher(kv_events, config.block_size)
            self.core = EngineCore(
                Scheduler(config, eos_token_id=self.eos_token_id),
                self._execute,
                depth=config.steps_in_flight,
                step_timeout_s=step_timeout_s,
                lora_names=lora_names,
                publish_kv_events=None if publisher is None else publisher.publish,
            )
            self.loop_task = asyncio.create_task(self._run())

    def _execute(self, scheduler_output: SchedulerOutput):
        """Send the step to every rank now; the returned coroutine gives the driver's reply."""
        return self._driver_reply(execute_step(self.workers, scheduler_output), bool(scheduler_output.kv_exports))

    async def _driver_reply(self, replies: asyncio.Future, exports: bool) -> ModelRunnerOutput | None:
        """The driver's output; with KV exports, every rank replied (output, its parts): the output carries each
        request's parts, in rank order."""
        replies = await replies
        if not exports:
            return replies[self.driver]
        output = replies[self.driver][0]
        output.kv_exports = {rid: [parts[rid] for _, parts in replies] for rid in replies[0][1]}
        return output

    async def _run(self) -> None:
        try:
            await self.core.run()
        except Exception as e:  # a dead or failing rank: no request can go on
            # The callers hear the reason in one line; the actor's log keeps where it was raised.
            logging.getLogger(__name__).exception("engine step failed")
            self.core.stop(f"engine step failed: {type(e).__name__}: {e}")

    # ---- requests in and out ------------------------------------------------------

    async def add_request(self, request: EngineRequest, channel: str = "sync") -> list[RequestOutput]:
        """Queue a (checked) request whose deltas go to ``channel``'s outbox (``get_outputs``); returns any
        immediate finals (EngineCore.add_request). A request with a KV transfer is queued once every rank holds its
        share (KVTransferError when one cannot fetch it); if it is not queued, no rank keeps any."""
        if request.kv_transfer is None:
            return self.core.add_request(request, channel)
        try:
            await self._stage_kv(request)
            return self.core.add_request(request, channel)
        except BaseException:
            for w in self.workers:
                w.drop_staged_kv.remote(request.request_id)
            raise

    async def _stage_kv(self, request: EngineRequest) -> None:
        start = time.perf_counter()
        results = await asyncio.gather(
            *[
                w.stage_kv.options(concurrency_group=KV_TRANSFERS).remote(request.request_id, request.kv_transfer.parts)
                for w in self.workers
            ],
            return_exceptions=True,
        )
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            cause = getattr(failed, "cause", None) or failed
            raise KVTransferError(
                f"request {request.request_id!r}: its prompt's KV did not reach every rank of this engine "
                f"({type(cause).__name__}: {str(cause).strip().splitlines()[-1]})"
            ) from None
        self.kv_transfers[0] += 1
        self.kv_transfers[1] += sum(results)
        self.kv_transfers[2] += time.perf_counter() - start

    async def prefix_hit_blocks(self, request: EngineRequest) -> int:
        """How many leading prompt blocks of ``request`` the prefix cache holds now (Scheduler.prefix_hit_blocks)."""
        return self.core.scheduler.prefix_hit_blocks(request)

    async def get_outputs(self, channel: str = "sync", received: int = 0) -> tuple[int, list[tuple]]:
        """The channel's next batch of deltas (packed: ``unpack_outputs`` gives the RequestOutputs) and its number,
        waiting until there is one (EngineCore.get_outputs)."""
        number, outputs = await self.core.get_outputs(channel, received)
        return number, pack_outputs(outputs)

    async def abort(self, request_id: str) -> list[RequestOutput]:
        if self.core.waits_with_staged_kv(request_id):
            for w in self.workers:
                w.drop_staged_kv.remote(request_id)
        return self.core.abort(request_id)

    # ---- LoRA adapters at run time ---------------------------------------------------

    async def add_lora(self, name: str, path: str) -> None:
        """Every rank reads adapter `name` into host memory, or none keeps it: a ValueError naming the adapter and
        the mismatch. The ranks read it on their LORA_READS thread while steps go on; no step names it before every
        rank has it."""
        self.core.check_new_adapter(name)
        try:
            await self.on_ranks("add_lora", name, path, group=LORA_READS)
        except Exception:  # no rank keeps what some could not load
            await asyncio.gather(*[w.call.remote("remove_lora", name) for w in self.workers], return_exceptions=True)
            raise
        self.core.lora_names.add(name)

    async def remove_lora(self, name: str) -> None:
        """Unload adapter `name`: a ValueError naming it when it is absent or a live request still runs with it.
        A step already sent that used it runs before the ranks take the call."""
        self.core.release_adapter(name)
        await asyncio.gather(*[w.call.remote("remove_lora", name) for w in self.workers])

    async def list_loras(self) -> list[str]:
        return sorted(self.core.lora_names)

    # ---- every rank: engine/controls.py's calls ----------------------------------------

    async def on_ranks(self, method: str, *args, group: str | None = None) -> list:
        """Every rank's reply to Worker method ``method``, sent to all of them before any is awaited (a broadcast
        they join together needs that), in rank order. A rank's ValueError (a refusal naming what it refuses) is
        raised as a plain ValueError carrying its message; another failure is raised as Ray gives it."""
        calls = [w.call if group is None else w.call.options(concurrency_group=group) for w in self.workers]
        results = await asyncio.gather(*[call.remote(method, *args) for call in calls], return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if isinstance(failed, ValueError):
            cause = getattr(failed, "cause", None) or failed  # the rank's ValueError inside Ray's error
            raise ValueError(str(cause).strip().splitlines()[-1].removeprefix("ValueError: ")) from None
        if failed is not None:
            raise failed
        return results

    async def update_weights_from_tensor(
        self, named_tensors: list, flush_cache: bool = True, weight_version: str | None = None
    ) -> None:
        """``named_tensors`` is ``[ref]``: the ObjectRef of the (name, tensor) list, boxed so that Ray hands it to
        this torch-free process unresolved; passed bare to every rank, each fetches it from the object store."""
        await self._update(flush_cache, weight_version, "update_weights", named_tensors[0])

    # ---- observability --------------------------------------------------------------

    async def stats(self) -> SchedulerStats:
        num, nbytes, seconds = self.kv_transfers
        return dataclasses.replace(
            self.core.stats(), num_kv_transfers=num, kv_transfer_bytes=nbytes, kv_transfer_s=seconds
        )

    async def routing_digest(self, limit: int) -> tuple[list[bytes], int]:
        """The prefix cache's block hashes (at most ``limit``) and the requests it holds (running and waiting)."""
        scheduler = self.core.scheduler
        return scheduler.cached_block_hashes(limit), len(scheduler.requests)

    async def check_health(self, timeout_s: float = 10.0) -> None:
        """Raise RuntimeError when the engine cannot serve. An idle loop sends no steps, so ask the ranks."""
        core = self.core
        if core.error is None and not core.scheduler.has_unfinished_requests():
            try:
                await asyncio.wait_for(asyncio.gather(*[w.check_health.remote() for w in self.workers]), timeout_s)
            except Exception as e:
                core.stop(f"health check failed: {type(e).__name__}: {e}")
        if core.error is not None:
            raise RuntimeError(f"the engine is unhealthy: {core.error}")
