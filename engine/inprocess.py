"""The in-process executor: one Scheduler and one Worker in this process, no Ray (tp=1 debugging, and
machines without Ray: nothing here imports it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from engine.config import EngineConfig, derive_scheduler_config, derive_worker_config
from engine.controls import EngineControls
from engine.core import EngineCore
from engine.interface import check_draft_model, resolve_max_model_len
from engine.request_check import check_request
from scheduler import (
    EngineRequest,
    KVPart,
    ModelRunnerOutput,
    RequestError,
    RequestOutput,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from workers.model_loader import read_model_spec
from workers.runner_inputs import PendingStep
from workers.worker import Worker

T = TypeVar("T")


class InProcessEngine(EngineControls):
    """The engine core (engine/core.py) and a single worker in one process, stepped by the caller.

    The same core and step loop the Ray engine's scheduler actor runs, its
    worker called directly: what tests and `--executor inprocess` use to debug
    the model path, and the GPU benches measure. With async scheduling (on by
    default on a GPU) two steps are in flight: each ``step`` applies one while
    the device runs the next, which the worker launched before the first one's
    sampled ids reached the host. ``scheduler`` is the core's. Implements
    interface.Engine (the caller steps it: ``step``) and client.EngineClient
    (a task of the caller's event loop steps it while a request runs:
    ``generate``); a caller uses one or the other, never both at once.
    ``queues`` holds one queue per ``generate`` stream still open, keyed by
    request id; ``stepper`` is the task that steps for them, and the only
    one that steps the core while it runs: the controls (engine/controls.py)
    wait for the core through it (``_until``), and the gate's opening starts
    it again for the streams held meanwhile.
    """

    adapters = None  # no other process reaches this engine (client.EngineClient)

    def __init__(self, config: EngineConfig) -> None:
        if config.world_size != 1:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size}, pipeline_parallel_size="
                f"{config.pipeline_parallel_size}: the in-process engine runs one rank; use the Ray engine for "
                f"tensor and pipeline parallelism"
            )
        self.config = config
        self.model_path = config.resolved_model()
        self.spec = read_model_spec(self.model_path, quantization=config.quantization)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        draft_spec = check_draft_model(config, self.model_path, self.spec, self.max_model_len)
        self.worker = Worker(
            derive_worker_config(
                config, self.model_path, self.max_model_len, model_spec=self.spec, draft_spec=draft_spec
            )
        )
        self.device = self.worker.init_device()
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.worker.block_bytes()} bytes; "
                f"raise kv_cache_bytes (now {config.kv_cache_bytes}) or gpu_memory_utilization"
            )
        num_host_blocks = self.worker.determine_num_host_blocks()
        self.worker.init_cache(num_blocks, num_host_blocks)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(
            derive_scheduler_config(
                config,
                num_blocks,
                self.max_model_len,
                num_host_blocks,
                self.worker.swap_cost_per_block(),
                on_gpu=str(self.device).startswith("cuda"),
            ),
            eos_token_id=self.spec.eos_token_id,
        )
        lora = getattr(self.worker.runner, "lora", None)
        self.kv_events = None
        if config.kv_events is not None:
            # Imported only when asked for: a GPU machine without Ray (tools/gpu_check.py) has no pyzmq.
            from engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(config.kv_events, config.block_size)
        self.core = EngineCore(
            self.scheduler,
            self._execute,
            lora_names=tuple(lora.adapters) if lora is not None else (),
            depth=self.scheduler.config.steps_in_flight,
            publish_kv_events=None if self.kv_events is None else self.kv_events.publish,
            until=self._until,
            reopened=self._reopened,
        )
        self.loop = asyncio.new_event_loop()  # where step() runs the core's loop, one step at a time
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.stepper: asyncio.Task | None = None

    def _execute(self, scheduler_output: SchedulerOutput) -> Awaitable[ModelRunnerOutput | None]:
        """Launch the step on the worker now; the returned coroutine gives its output."""
        return self._output(self.worker.launch(scheduler_output), scheduler_output)

    async def _output(self, pending: PendingStep, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        # Awaited, not blocked on: the core meanwhile applies the step before it and launches the next one (with
        # async scheduling), which a blocking wait here would hold up.
        await pending.wait()
        out = self.worker.finish(pending)
        if scheduler_output.kv_exports:  # the arrays themselves: a KV transfer within this process
            head_start, num_heads = self.worker.kv_heads()
            out.kv_exports = {
                rid: [KVPart(head_start=head_start, num_heads=num_heads, data=blocks)]
                for rid, blocks in self.worker.take_kv_exports().items()
            }
        return out

    def add_request(self, request: EngineRequest) -> list[RequestOutput]:
        """Queue a request; one with a KV transfer (whose parts hold arrays: from an engine in this process) has
        its KV staged on the worker first, and kept only if it is queued."""
        return self._add(self.check_request(request), "sync")

    def _add(self, request: EngineRequest, channel: str) -> list[RequestOutput]:
        if request.kv_transfer is None:
            return self.core.add_request(request, channel)
        try:
            self.worker.stage_kv(request.request_id, [(p.head_start, p.data) for p in request.kv_transfer.parts])
            return self.core.add_request(request, channel)
        except BaseException:
            self.worker.drop_staged_kv(request.request_id)
            raise

    async def prefix_hit_blocks(self, request: EngineRequest) -> int:
        return self.scheduler.prefix_hit_blocks(request)

    def lora_names(self) -> set[str]:
        return set(self.core.lora_names)

    def add_lora(self, name: str, path: str) -> None:
        """Load adapter `name` from `path` (ValueError naming it: already loaded, LoRA off, or a mismatch)."""
        self.core.check_new_adapter(name)
        self.worker.add_lora(name, path)
        self.core.lora_names.add(name)

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name` (ValueError naming it: absent, or a live request still runs with it)."""
        self.core.release_adapter(name)
        self.worker.remove_lora(name)

    def sync(self, call: Awaitable[T]) -> T:
        """Run one of the async controls (engine/controls.py) to completion from synchronous code, on the loop
        ``step`` runs the core on."""
        return self.loop.run_until_complete(call)

    async def on_ranks(self, method: str, *args: Any) -> list:
        """The worker's reply to one of its methods, as the list of every rank's (one here)."""
        return [getattr(self.worker, method)(*args)]

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Every rank's reply to Worker method ``method`` (one rank here), beside the steps."""
        return await self.on_ranks(method, *args)

    async def get_weights_by_name(self, name: str) -> list:
        """Every rank's copy of parameter ``name`` (model.named_parameters' name; one rank here)."""
        return await self.on_ranks("get_weights_by_name", name)

    def step(self) -> list[RequestOutput]:
        """One step of the core's loop, and the deltas it made; a step that fails ends its requests with an
        "error" delta, and the engine goes on taking requests (one process: no rank can disagree)."""
        try:
            self.loop.run_until_complete(self.core.run(max_steps=1))
        except Exception as e:  # the step's requests cannot go on; everyone hears why
            self.core.fail_all(f"engine step failed: {type(e).__name__}: {e}")
        return self.core.take_outputs("sync")

    def abort(self, request_id: str) -> list[RequestOutput]:
        if self.core.waits_with_staged_kv(request_id):
            self.worker.drop_staged_kv(request_id)
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    # ---- client.EngineClient -----------------------------------------------------------------

    def check_request(self, request: EngineRequest) -> EngineRequest:
        """The request as this engine takes it, or a RequestError naming the field (request_check.check_request)."""
        return check_request(request, self.spec, self.max_model_len)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's deltas as they come; leaving the loop early (or being cancelled) aborts it. The request
        is checked here, before the stream exists: a RequestError is raised by this call."""
        return self._stream(self.check_request(request))

    async def _stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        if request_id in self.queues:  # its queue would take the running caller's deltas
            raise RequestError("request_id", request_id, "a request with this id is still running")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        remaining = request.sampling_params.n
        try:
            for out in self._add(request, "async"):
                remaining -= 1
                yield out
            if remaining:
                self._ensure_stepper()
            while remaining:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                remaining -= out.finished
                yield out
        finally:
            self.queues.pop(request_id, None)
            if remaining:
                self.abort(request_id)

    def _ensure_stepper(self) -> None:
        loop = asyncio.get_running_loop()
        if self.stepper is None or self.stepper.done() or self.stepper.get_loop() is not loop:
            self.stepper = loop.create_task(self._step_streams())

    async def _step_streams(self) -> None:
        """Step while stepping does anything (a request runs and the gate is open, or a step is in flight),
        handing each step's deltas to their streams (as ``step`` does, a failed step ends its requests with an
        "error" delta), yielding to the streams between steps."""
        while self.core.wants_step():
            try:
                await self.core.run(max_steps=1)
            except Exception as e:  # the step's requests cannot go on; everyone hears why
                self.core.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._hand_out()
            await asyncio.sleep(0)

    def _hand_out(self) -> None:
        """The async channel's deltas to their streams."""
        for out in self.core.take_outputs("async"):
            if (queue := self.queues.get(out.request_id)) is not None:
                queue.put_nowait(out)

    async def _until(self, done: Callable[[], bool]) -> None:
        """Step the core until ``done`` holds (EngineCore's ``until``), through the stepper, so that no two
        callers step it at once; the deltas routed meanwhile (a pause's aborts too) go to their streams."""
        while not done():
            self._ensure_stepper()
            await asyncio.shield(self.stepper)  # a caller leaving does not stop the streams' stepping
        self._hand_out()

    def _reopened(self) -> None:
        """The gate opened (EngineCore's ``reopened``): the streams' requests it held may run."""
        self._hand_out()
        if self.queues and self.core.wants_step():
            self._ensure_stepper()

    async def abort_request(self, request_id: str) -> None:
        """Abort the request (its KV blocks are freed); its open stream ends with the abort's final deltas."""
        for out in self.abort(request_id):
            if (queue := self.queues.get(out.request_id)) is not None:
                queue.put_nowait(out)

    def end_callers(self, error: BaseException) -> int:
        """End every ``generate`` still running by raising ``error`` in it, each aborting its request as it leaves;
        returns how many were open."""
        for queue in self.queues.values():
            queue.put_nowait(error)
        return len(self.queues)

    async def get_stats(self) -> SchedulerStats:
        return self.stats()

    def check_health(self) -> None:
        if self.worker is None:
            raise RuntimeError("the engine is shut down")

    async def routing_digest(self, limit: int) -> tuple[list[bytes], int]:
        """The prefix cache's block hashes (at most ``limit``) and the requests it holds (running and waiting)."""
        return self.scheduler.cached_block_hashes(limit), len(self.scheduler.requests)

    async def list_loras(self) -> set[str]:
        return self.lora_names()

    async def load_lora(self, name: str, path: str) -> None:
        self.add_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        self.remove_lora(name)

    def shutdown(self) -> None:
        """Drop the model and KV cache now rather than at garbage collection (a process building several
        engines, like the benchmarks, would otherwise hold two at once), and send the KV events still queued."""
        if self.stepper is not None:
            self.stepper.cancel()
        self.core.drop_in_flight()
        self.loop.run_until_complete(asyncio.sleep(0))  # the cancelled steps' tasks end
        self.worker = None
        self.loop.close()
        if self.kv_events is not None:
            self.kv_events.close()
