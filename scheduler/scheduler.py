"""Continuous-batching scheduler: who runs each step, how many tokens each computes."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Container

from scheduler.block_hash import BlockHash
from scheduler.config import SchedulerConfig, SchedulerStats
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.outputs import (
    CachedRequestData,
    KVImport,
    KVTransfer,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
)
from scheduler.request import FINISH_REASONS, EngineRequest, Request, RequestStatus
from scheduler.sampling_params import RequestError, SamplingParams
from scheduler.speculation import Speculation
from scheduler.waiting_queue import WAITING_QUEUES


class Scheduler:
    """Decides each step which requests compute how many tokens, within memory and a token budget.

    There are no prefill and decode phases: every request's ``num_computed_tokens``
    chases its ``num_tokens``, so prefill chunks and decodes share a step.
    Invariants:
    - every running request holds blocks for all its computed tokens;
    - ``num_computed_tokens`` advances when a step is scheduled, and blocks are
      entered into the prefix cache when the step's output comes back;
    - a request that samples this step is exactly one whose computed count
      reaches its token count (the workers use the same rule);
    - a finished request holds no blocks and is reported once in
      ``finished_req_ids`` so the workers drop it;
    - a request preempted by swap (in ``swapped``) keeps its computed tokens in
      host blocks; swapped requests resume, KV intact, before any waiting
      request is admitted (the order of vLLM v0).

    Async scheduling (the Ray engine loop keeps two steps in flight: step N+1
    is scheduled before step N's output is applied):
    - a request's work is ``num_tokens + num_output_placeholders -
      num_computed_tokens``: a step that samples a request adds a placeholder,
      ``update_from_output`` removes it as it applies the token. A request
      whose outputs plus placeholders reach ``max_tokens`` (or whose tokens
      plus placeholders reach ``max_model_len``) is not scheduled again; one
      that stops on EOS or a stop token while its next step is in flight
      wastes that step, and the late token is dropped;
    - a step's outputs go to the Request objects that step scheduled (kept in
      ``in_flight`` by step id), by object, never by id: a finished request's
      id may be reused by a new caller before the step returns, and the new
      request never receives the old one's token; finished ones are skipped;
    - a token sampled for a request preempted while its step was in flight is
      still applied (the workers appended it, and the two copies must agree):
      it was computed from KV intact when the step ran, since ranks run steps
      in order and the blocks step N+1 frees or swaps out are touched only
      after step N. It may finish the request in the waiting or swapped queue.
      A waiting or swapped request has no placeholders when admitted: the loop
      applies step N's output before it schedules step N+2;
    - blocks enter the prefix cache when their token ids are known
      (``block_hashes``) and their tokens are scheduled (``num_computed_tokens``
      counts the steps in flight too): any request that reads a cached block is
      admitted after that, so it runs in a later step than the one writing it.
    In the serial loop placeholders are always 0 at ``schedule()``, and the
    same code serves both.

    Pipeline parallelism (``pipeline_parallel_size`` P > 1; the loop keeps up to
    P steps in flight, so that every stage has a step to run):
    - a request with a placeholder (a step in flight samples it) is not
      scheduled again until that step's output is applied: the first stage
      would need the token before the last stage has sampled it. A prefill
      chunk that samples nothing may be in several steps in flight (each stage
      runs steps in order, so chunk k's KV is written before chunk k+1 reads
      it); that is the one way a request is in two steps in flight;
    - so a waiting or swapped request with a placeholder (preempted while its
      step was in flight) is not admitted either, and the invariant that
      admitted requests have no placeholders holds for P steps in flight;
    - a step takes at most ceil(live requests / min(P, steps in flight))
      requests, so that the running batch spreads over the steps in flight
      instead of one step taking them all and the next finding none (with
      one step in flight, the serial loop, a step takes them all);
    - a token applied by ``update_from_output`` is kept in ``unsent`` and sent
      with the request's next step (``CachedRequestData.new_token_ids``) to the
      ranks that do not sample.

    Speculative decoding (``num_speculative_tokens`` k > 0): a decoding request may carry up to k proposed
    tokens, verified in the step that computes them; ``Speculation`` states what the scheduler keeps for them.

    Prefill/decode disaggregation:
    - a request with ``kv_export_from_block`` (in ``exporting`` until then) has its prompt's blocks from that one
      on exported by the step that samples its first token: the ranks read them after that step's forward, and
      its blocks are freed only once that step's output is applied, so no later step overwrites them first;
    - a request with ``kv_transfer`` is admitted like any other, its prefix-cache hit counted first; the blocks
      after the hit up to the prompt's last are written by the ranks (``kv_imports``) before the forward of the
      step that admits it, which computes only its transferred token. When its hit ends before the transfer's
      first block (evicted since the caller asked ``prefix_hit_blocks``) it computes the prompt itself. The ranks
      hold its staged KV until then: a request that leaves before it is admitted is still reported in
      ``finished_req_ids``, so they drop it.
    """

    def __init__(self, config: SchedulerConfig, eos_token_id: int | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.eos_token_id = eos_token_id
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.num_host_blocks,
            config.enable_kv_cache_events,
        )
        self.requests: dict[str, Request] = {}  # live requests (children for n > 1)
        # caller id -> its requests, by object: a finished child's id may be reused by an unrelated caller
        self.children: dict[str, list[Request]] = {}
        # n > 1 siblings deferred until child 0 has computed the prompt, by child 0's id (not yet waiting)
        self.deferred: dict[str, list[Request]] = {}
        self.waiting = WAITING_QUEUES[config.policy]()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the workers next step
        self.in_flight: dict[int, dict[str, Request]] = {}  # step id -> the requests it scheduled, by object
        self.pipelined = config.pipeline_parallel_size > 1
        self.unsent: dict[str, list[int]] = {}  # pipelined: live request id -> tokens its next step carries
        self.step_cap = config.max_num_seqs  # requests one step may take (pipelined: see schedule)
        self.num_preemptions = 0
        self.num_steps = 0
        self.last_num_scheduled_tokens = 0
        self.last_num_admitted = 0
        self.speculation = Speculation(config)
        self.spec_tokens: dict[str, list[int]] = {}  # this step's proposals by request id
        self.exporting: dict[str, Request] = {}  # live requests whose first token's step exports their KV
        self.kv_imports: dict[str, KVImport] = {}  # this step's

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: EngineRequest) -> list[RequestOutput]:
        """Queue a request; returns the final outputs of any child that can never run.

        ``n > 1`` fans out into n children; children 1..n-1 are deferred until
        child 0 has computed the prompt, so that they reuse its blocks through the
        prefix cache instead of computing the same prompt n times.
        """
        request_id, params = request.request_id, request.sampling_params
        n = params.n
        child_ids = self.check_request(request)
        children = [
            Request(
                request
                if n == 1
                else dataclasses.replace(request, request_id=req_id, sampling_params=_child_params(params, i)),
                eos_token_id=self.eos_token_id,
                block_size=self.block_size,
                parent_id=request_id if n > 1 else None,
                index=i,
            )
            for i, req_id in enumerate(child_ids)
        ]
        self.children[request_id] = children
        for child in children:
            self.requests[child.request_id] = child
        reason = self._infeasible_reason(children[0])
        if reason is not None:
            return [self._finish(c, RequestStatus.FINISHED_IGNORED, reason) for c in children]
        if request.kv_export_from_block is not None:
            self.exporting[request_id] = children[0]
        self.waiting.add(children[0])
        if n > 1 and self.config.enable_prefix_caching:
            self.deferred[children[0].request_id] = children[1:]
        else:
            for child in children[1:]:
                self.waiting.add(child)
        return []

    def check_request(self, request: EngineRequest, held: Container[str] = ()) -> list[str]:
        """Refuse (ValueError) a request ``add_request`` could not take: its id still running (here, or among the
        ids the caller ``held`` back), or a KV transfer that does not fit this engine. Returns its children's ids.
        The engine core checks a request it holds back (paused, asleep) here, so that taking it later cannot fail."""
        request_id, n = request.request_id, request.sampling_params.n
        if request.kv_transfer is not None or request.kv_export_from_block is not None:
            self._check_disaggregated(request)
        child_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        running = request_id in self.children or request_id in held
        if running or any(child_id in self.requests for child_id in child_ids):
            raise ValueError(f"request_id={request_id!r} is invalid: a request with this id is still running")
        return child_ids

    def _check_disaggregated(self, request: EngineRequest) -> None:
        """A request of prefill/decode disaggregation: one sample, and a transfer that fits this engine."""
        params, transfer = request.sampling_params, request.kv_transfer
        num_prompt_blocks = -(-len(request.prompt_token_ids) // self.block_size)
        if params.n != 1:
            raise RequestError("n", params.n, "a request whose KV moves between engines has one sample")
        first = request.kv_export_from_block
        if first is not None and (type(first) is not int or not 0 <= first <= num_prompt_blocks):
            raise RequestError("kv_export_from_block", first, f"must be a block of the prompt, 0..{num_prompt_blocks}")
        if transfer is None:
            return
        if transfer.block_size != self.block_size:
            raise RequestError(
                "kv_transfer.block_size", transfer.block_size, f"this engine's blocks hold {self.block_size} tokens"
            )
        if transfer.num_prompt_tokens != len(request.prompt_token_ids):
            raise RequestError(
                "kv_transfer.num_prompt_tokens",
                transfer.num_prompt_tokens,
                f"the request's prompt has {len(request.prompt_token_ids)} tokens",
            )
        if not 0 <= transfer.first_block <= num_prompt_blocks:
            raise RequestError("kv_transfer.first_block", transfer.first_block, f"must be 0..{num_prompt_blocks}")
        if not transfer.token_ids or len(transfer.token_ids) >= params.max_tokens:
            raise RequestError(
                "kv_transfer.token_ids",
                transfer.token_ids,
                f"the tokens sampled after the prompt: at least one, fewer than max_tokens={params.max_tokens}",
            )

    def prefix_hit_blocks(self, request: EngineRequest) -> int:
        """How many of the request's leading prompt blocks the prefix cache (device, then host tier) holds now:
        what a prefill engine need not send this engine. Counts no lookup in the stats."""
        probe = Request(request, eos_token_id=self.eos_token_id, block_size=self.block_size)
        hits, _ = self.kv.get_computed_blocks(probe)
        host_hits = self.kv.get_host_hits(probe, len(hits)) if self.kv.host_pool is not None else ()
        return len(hits) + len(host_hits)

    def _infeasible_reason(self, request: Request) -> str | None:
        config = self.config
        if request.num_prompt_tokens >= config.max_model_len:
            return (
                f"prompt has {request.num_prompt_tokens} tokens, but max_model_len={config.max_model_len} "
                f"leaves no room to generate"
            )
        max_tokens = min(request.max_total_tokens, config.max_model_len)
        needed = -(-max_tokens // self.block_size)
        if needed > self.kv.num_usable_blocks:
            return (
                f"request needs up to {needed} KV blocks ({max_tokens} tokens) but the cache has only "
                f"{self.kv.num_usable_blocks}; lower max_tokens or grow the KV cache"
            )
        if not config.enable_chunked_prefill and request.num_prompt_tokens > config.max_num_batched_tokens:
            return (
                f"prompt has {request.num_prompt_tokens} tokens, over max_num_batched_tokens="
                f"{config.max_num_batched_tokens} with chunked prefill off"
            )
        return None

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort a caller's request (all its children) in any state; unknown or finished ids are a no-op."""
        outputs = []
        for request in self.children.get(request_id, ()):
            if not request.is_finished:
                outputs.append(self._finish(request, RequestStatus.FINISHED_ABORTED))
        return outputs

    def waits_with_staged_kv(self, request_id: str) -> bool:
        """Whether the caller's request waits with KV its ranks staged (a transfer not yet admitted): aborted, its
        transport drops the KV at once rather than at the next step, which an idle engine may not take soon."""
        return any(r.kv_transfer is not None for r in self.children.get(request_id, ()))

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every live request with an error (the engine cannot run them)."""
        self.in_flight.clear()
        return [self._finish(r, RequestStatus.FINISHED_ERROR, error) for r in list(self.requests.values())]

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> RequestOutput:
        req_id = request.request_id
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
        request.status = status
        request.error = error
        self.kv.free(request)
        self.requests.pop(req_id, None)
        self.unsent.pop(req_id, None)
        self.exporting.pop(req_id, None)
        # Scheduled, so the workers hold it; or never admitted with KV the ranks staged for it.
        if request.num_cached_tokens >= 0 or request.kv_transfer is not None:
            self.finished_req_ids.add(req_id)
        self._release_deferred(request)
        caller_id = request.parent_id or req_id
        siblings = self.children.get(caller_id)
        if siblings is not None and all(s.is_finished for s in siblings):
            del self.children[caller_id]
        return RequestOutput(
            request_id=caller_id,
            index=request.index,
            new_token_ids=[],
            finished=True,
            finish_reason=FINISH_REASONS[status],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=error,
            queued_s=request.queued_s,
        )

    def _release_deferred(self, request: Request) -> None:
        deferred = self.deferred.pop(request.request_id, None)
        if not deferred:
            return
        if request.status == RequestStatus.FINISHED_ABORTED:
            return  # the caller aborted the whole group; the siblings are finished by the same abort
        for sibling in reversed(deferred):
            if sibling.request_id in self.requests:
                self.waiting.requeue(sibling)

    def reset_prefix_cache(self) -> bool:
        """Forget every block the prefix cache holds (both tiers), so no later request reads KV computed before
        now: after a weight update, or once the KV tensors were freed. Always True, live requests or not: they
        keep their own KV, and none of it is cached again (KVCacheManager says why)."""
        return self.kv.reset_prefix_cache()

    def lora_in_use(self, name: str) -> bool:
        """Whether a live request runs with adapter `name` (unloading it would fail that request)."""
        return any(r.lora_name == name for r in self.requests.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def cached_block_hashes(self, limit: int) -> list[BlockHash]:
        """Up to ``limit`` hashes the prefix cache holds, most recently cached first (what a request router
        needs to send a request where its prefix is)."""
        return list(itertools.islice(reversed(self.kv.block_pool.cached_blocks), limit))

    def stats(self) -> SchedulerStats:
        spec = self.speculation
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + sum(map(len, self.deferred.values())),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_scheduled_tokens=self.last_num_scheduled_tokens,
            num_admitted=self.last_num_admitted,
            num_swapped=len(self.swapped),
            host_cache_usage=self.kv.host_usage(),
            host_prefix_cache_hits=self.kv.host_prefix_cache_hits,
            num_blocks_swapped_out=self.kv.num_blocks_swapped_out,
            num_blocks_swapped_in=self.kv.num_blocks_swapped_in,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted,
            spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_pos) if spec.num_spec else None,
        )

    # ---- one step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step: running requests first, then swapped ones, then waiting ones, unless this step had to preempt
        (and waiting ones only once no request is left swapped)."""
        config = self.config
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        preempted: list[Request] = []
        self.spec_tokens = {}
        if self.pipelined:
            live = len(self.running) + len(self.waiting) + len(self.swapped)
            spread = min(config.pipeline_parallel_size, config.steps_in_flight)
            self.step_cap = min(config.max_num_seqs, -(-live // spread))
        budget = self._schedule_running(config.max_num_batched_tokens, num_scheduled, cached, preempted)
        new_data: list[NewRequestData] = []
        num_admitted = 0
        if not preempted and self.swapped:
            budget, num_admitted = self._schedule_swapped(budget, num_scheduled, cached)
        if not preempted and not self.swapped:
            budget, num_waiting_admitted = self._schedule_waiting(budget, num_scheduled, cached, new_data)
            num_admitted += num_waiting_admitted
        if self.pipelined:
            cached.new_token_ids = [self.unsent.pop(req_id, []) for req_id in cached.req_ids]
        swap_out, swap_in = self.kv.take_swaps()
        kv_exports = self._take_exports(num_scheduled) if self.exporting else {}
        kv_imports, self.kv_imports = self.kv_imports, {}
        finished = self.finished_req_ids
        self.finished_req_ids = set()
        total = config.max_num_batched_tokens - budget
        self.num_steps += 1
        self.in_flight[self.num_steps] = self._add_placeholders(num_scheduled)
        self.last_num_scheduled_tokens = total
        self.last_num_admitted = num_admitted
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            preempted_req_ids={r.request_id for r in preempted},
            step_id=self.num_steps,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            scheduled_spec_decode_tokens=self.spec_tokens,
            kv_exports=kv_exports,
            kv_imports=kv_imports,
        )

    def _take_exports(self, num_scheduled: dict[str, int]) -> dict[str, list[int]]:
        """The blocks of each exporting request whose prompt this step completes (it samples its first token)."""
        exports = {}
        for req_id, request in list(self.exporting.items()):
            if req_id in num_scheduled and request.num_computed_tokens >= request.num_prompt_tokens:
                num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
                block_ids = self.kv.get_block_ids(req_id)
                exports[req_id] = block_ids[request.kv_export_from_block : num_prompt_blocks]
                del self.exporting[req_id]
        return exports

    def _add_placeholders(self, num_scheduled: dict[str, int]) -> dict[str, Request]:
        """The step's requests by id; each one it samples (its computed count now reaches its tokens plus
        placeholders) gains a placeholder. Done once the plan is final, so a victim taken back mid-plan
        never had one."""
        requests = self.requests
        step = {}
        for req_id in num_scheduled:
            request = step[req_id] = requests[req_id]
            sampled_at = request.num_tokens + request.num_output_placeholders + len(request.spec_token_ids)
            if request.num_computed_tokens == sampled_at:
                request.num_output_placeholders += 1
        return step

    def _schedule_running(
        self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData, preempted: list[Request]
    ) -> int:
        """Running requests, in order, preempting the policy's victim (the request it would run last) when memory
        runs out; returns the budget left. This loop is the decode hot path: it writes the step's diff as it goes."""
        threshold = self.config.long_prefill_token_threshold
        max_model_len = self.config.max_model_len
        block_size = self.block_size
        req_to_blocks = self.kv.req_to_blocks
        running = self.running
        step_cap, pipelined = self.step_cap, self.pipelined
        speculation, spec_tokens = self.speculation, self.spec_tokens
        proposer = speculation.proposer
        i = 0
        while i < len(running) and budget > 0 and len(num_scheduled) < step_cap:
            request = running[i]
            req_id = request.request_id
            num_tokens = len(request.all_token_ids)
            placeholders = request.num_output_placeholders
            speculable = proposer is not None and request.sampling_params.speculable
            if placeholders:
                if (
                    pipelined
                    or speculable
                    or len(request.output_token_ids) + placeholders >= request.sampling_params.max_tokens
                    or num_tokens + placeholders >= max_model_len
                ):
                    i += 1
                    continue  # a step in flight samples its last token (pipelined: its next input): wait for it
                num_tokens += placeholders
            num_computed = request.num_computed_tokens
            num_new = min(num_tokens - num_computed, budget, threshold or budget)
            drafts, lookahead = speculation.plan(request, num_tokens, num_new, budget) if speculable else ((), 0)
            if num_computed + num_new + lookahead <= len(req_to_blocks[req_id]) * block_size:
                new_block_ids = []  # the last block still has room
            else:
                new_blocks, freed_budget, num_unscheduled = self._allocate_preempting(
                    request, num_new, num_scheduled, cached, preempted, lookahead
                )
                budget += freed_budget
                i -= num_unscheduled  # victims scheduled earlier in this loop sat before index i
                if new_blocks is None:
                    continue
                new_block_ids = [b.block_id for b in new_blocks]
            if drafts:
                spec_tokens[req_id] = request.spec_token_ids = drafts
                num_new += len(drafts)
            num_scheduled[req_id] = num_new
            budget -= num_new
            cached.req_ids.append(req_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(num_computed)
            request.num_computed_tokens = num_computed + num_new
            i += 1
        return budget

    def _allocate_preempting(
        self,
        request: Request,
        num_new: int,
        num_scheduled: dict[str, int],
        cached: CachedRequestData,
        preempted: list[Request],
        num_lookahead: int = 0,
    ) -> tuple[list | None, int, int]:
        """Blocks for ``num_new`` more tokens of ``request`` (and ``num_lookahead`` proposed ones), preempting the
        policy's victims until they fit; None when ``request`` itself was the victim. Also returns the budget the
        victims had been given this step and how many of them had been scheduled already."""
        freed_budget = num_unscheduled = 0
        new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=num_lookahead)
        while new_blocks is None:
            victim = self.waiting.pick_victim(self.running)
            if victim.request_id in num_scheduled:
                freed_budget += self._unschedule(victim, num_scheduled, cached)
                num_unscheduled += 1
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                break
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=num_lookahead)
        return new_blocks, freed_budget, num_unscheduled

    def _schedule_waiting(
        self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData, new_data: list[NewRequestData]
    ) -> tuple[int, int]:
        """Waiting requests, in policy order, until one does not fit; returns the budget left and how many
        were admitted."""
        config = self.config
        threshold = config.long_prefill_token_threshold
        running, waiting = self.running, self.waiting
        allocate, get_computed = self.kv.allocate_slots, self.kv.get_computed_blocks
        get_host_hits, host_tier = self.kv.get_host_hits, self.kv.host_pool is not None
        num_admitted = 0
        while budget > 0 and len(running) < config.max_num_seqs and len(num_scheduled) < self.step_cap:
            request = waiting.peek()
            if request is None or request.num_output_placeholders:
                break  # (pipelined) preempted while a step in flight samples it: admitted once that returns
            if not self._lora_fits(request):
                break  # its adapter waits for a slot: a running adapter's requests must finish first
            params = request.sampling_params
            if params.prompt_logprobs is None and params.pooling is None:
                hits, num_hit_tokens = get_computed(request)
                host_hits = get_host_hits(request, len(hits)) if host_tier else ()
            else:  # a cached prompt token is never computed: its logprob (vLLM's rule) or hidden state would be missing
                hits, num_hit_tokens, host_hits = [], 0, ()
            num_host_hit_tokens = len(host_hits) * self.block_size
            num_hit_tokens += num_host_hit_tokens
            transfer = request.kv_transfer
            if transfer is not None and num_hit_tokens < transfer.first_block * self.block_size:
                transfer = None  # its leading blocks were evicted since: computed here (its ranks drop the staged KV)
            if transfer is not None:
                num_new = request.num_tokens - num_hit_tokens
                if allocate(request, num_new, num_hit_tokens, hits, host_hits=host_hits) is None:
                    break
                waiting.pop()
                self.kv.record_prefix_lookup(request, num_hit_tokens, num_host_hit_tokens)
                self._admit_transferred(request, num_hit_tokens, transfer, new_data)
                num_scheduled[request.request_id] = request.num_tokens - request.num_prompt_tokens
                budget -= num_scheduled[request.request_id]
                num_admitted += 1
                continue
            num_new = request.num_tokens - num_hit_tokens
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            if allocate(request, num_new, num_hit_tokens, hits, host_hits=host_hits) is None:
                break
            waiting.pop()
            self.kv.record_prefix_lookup(request, num_hit_tokens, num_host_hit_tokens)
            self._admit(request, num_hit_tokens, cached, new_data)
            request.num_computed_tokens = num_hit_tokens + num_new
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            num_admitted += 1
        return budget, num_admitted

    def _schedule_swapped(
        self, budget: int, num_scheduled: dict[str, int], cached: CachedRequestData
    ) -> tuple[int, int]:
        """Swapped requests, highest priority first, until one does not fit: each gets device blocks, its KV is
        copied back this step, and it goes on from its computed tokens. Returns the budget left and how many
        resumed."""
        config = self.config
        threshold = config.long_prefill_token_threshold
        key = self.waiting.order_key
        num_resumed = 0
        while self.swapped and budget > 0 and len(self.running) < config.max_num_seqs:
            request = min(self.swapped, key=key)
            if len(num_scheduled) >= self.step_cap or request.num_output_placeholders:
                break  # (pipelined) this step is full, or a step in flight samples it
            if not self._lora_fits(request):
                break
            num_computed = request.num_computed_tokens
            num_new = min(request.num_tokens - num_computed, budget, threshold or budget)
            if not self.kv.swap_in(request, num_new):
                break
            self.swapped.remove(request)
            self._admit(request, num_computed, cached, [])
            request.num_computed_tokens = num_computed + num_new
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            num_resumed += 1
        return budget, num_resumed

    def _lora_fits(self, request: Request) -> bool:
        """Whether the running batch may take `request` and still use at most ``max_loras`` adapters (the ranks'
        resident slots): every step then fits the slots, and a request of another adapter waits, never refused."""
        name = request.lora_name
        if name is None:
            return True
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        return name in running or len(running) < self.config.max_loras

    def _admit_transferred(
        self, request: Request, num_hit_tokens: int, transfer: KVTransfer, new_data: list[NewRequestData]
    ) -> None:
        """A request whose prompt's KV came from another engine: the blocks after its cache hit are written from
        the KV its ranks staged, and this step computes its transferred tokens (it samples the one after them)."""
        req_id = request.request_id
        first = num_hit_tokens // self.block_size
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        if first < num_prompt_blocks:  # else its cache held every block (its ranks drop the staged KV)
            block_ids = self.kv.get_block_ids(req_id)[first:num_prompt_blocks]
            self.kv_imports[req_id] = KVImport(block_ids=block_ids, offset=first - transfer.first_block)
        self._admit(request, num_hit_tokens, CachedRequestData(), new_data, num_computed=request.num_prompt_tokens)
        request.num_computed_tokens = request.num_tokens

    def _admit(
        self,
        request: Request,
        num_hit_tokens: int,
        cached: CachedRequestData,
        new_data: list[NewRequestData],
        num_computed: int | None = None,
    ) -> None:
        """Into the running batch, and into the step's diff: whole as new, or its block table anew if resumed.
        ``num_computed`` (default: the hit) is where its computation starts (a KV transfer's: the prompt's end)."""
        req_id = request.request_id
        assert not request.num_output_placeholders, f"{req_id} admitted with a step in flight"
        block_ids = self.kv.get_block_ids(req_id)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
            request.queued_s = time.monotonic() - request.arrival_time
        if request.status == RequestStatus.PREEMPTED:
            cached.req_ids.append(req_id)
            cached.resumed_from_preemption.append(True)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(num_hit_tokens)
        else:
            sampled_elsewhere = request.kv_transfer is not None  # its first outputs came with a KV transfer
            new_data.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=(request.prompt_token_ids if sampled_elsewhere else request.all_token_ids).copy(),
                    sampling_params=request.sampling_params,
                    block_ids=block_ids,
                    num_computed_tokens=num_hit_tokens if num_computed is None else num_computed,
                    lora_name=request.lora_name,
                    output_token_ids=request.output_token_ids.copy() if sampled_elsewhere else [],
                )
            )
            request.kv_transfer = None
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _unschedule(self, request: Request, num_scheduled: dict[str, int], cached: CachedRequestData) -> int:
        """Take back a request already scheduled this step (a priority victim); returns its tokens."""
        j = cached.req_ids.index(request.request_id)
        request.num_computed_tokens = cached.num_computed_tokens[j]
        if self.spec_tokens.pop(request.request_id, None) is not None:
            request.spec_token_ids = []
        for column in (
            cached.req_ids,
            cached.resumed_from_preemption,
            cached.new_block_ids,
            cached.num_computed_tokens,
        ):
            del column[j]
        return num_scheduled.pop(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Swap the victim's KV out to the host tier when that pays (``_swap_pays``) and fits, else recompute:
        free its blocks and put it back in the waiting queue (``requeue``: where its policy puts a preempted one)."""
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self._swap_pays(request) and self.kv.swap_out(request):
            self.swapped.append(request)
            return
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.waiting.requeue(request)

    def _swap_pays(self, request: Request) -> bool:
        """The cost model of ``preemption_mode="auto"``: recomputing costs one unit per computed token that the
        prefix cache would not give back (those outside the request's hashed blocks); swapping costs
        ``swap_cost_per_block`` units per block holding computed tokens (out, then back in)."""
        mode = self.config.preemption_mode
        if mode == "recompute" or self.kv.host_pool is None:
            return False
        if mode == "swap":
            return True
        num_computed = request.num_computed_tokens
        recompute = num_computed - self.kv.num_prefix_cached_tokens(request)
        return -(-num_computed // self.block_size) * self.config.swap_cost_per_block < recompute

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply a step's sampled tokens to the requests it scheduled (by object; finished ones are skipped),
        check stop rules, cache newly computed blocks; one delta per sampled request."""
        step = self.in_flight.pop(scheduler_output.step_id)
        cache_blocks = self.kv.cache_computed_blocks
        outputs = self._apply_other_results(step, runner_output)
        append_out = outputs.append
        logprobs = runner_output.logprobs
        max_model_len = self.config.max_model_len
        finished = RequestStatus.FINISHED_STOPPED
        for i, (req_id, token) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            request = step[req_id]
            request.num_output_placeholders -= 1
            if request.spec_token_ids:
                out = self._apply_verified(request, token, runner_output.num_accepted_tokens[i], runner_output, i)
                if out is not None:
                    append_out(out)
                continue
            if request.status >= finished:
                continue  # aborted, or stopped by an earlier step's token: this one is past its end
            request.append_output_token(token)
            num_outputs = len(request.output_token_ids)
            new_logprobs = None if logprobs is None or logprobs[i] is None else [logprobs[i]]
            params = request.sampling_params
            if (
                token != request.eos_token_id
                and not params.stop_token_ids
                and num_outputs < params.max_tokens
                and len(request.all_token_ids) < max_model_len
            ):
                status = None  # the common case, decided without a call
            else:
                status = _stop_status(request, token, max_model_len)
            if status is None:
                if self.pipelined:
                    self.unsent.setdefault(req_id, []).append(token)
                rid = request.parent_id or req_id
                out = RequestOutput(
                    request_id=rid, index=request.index, new_token_ids=[token], new_logprobs=new_logprobs
                )
                append_out(out)
                if self.deferred and req_id in self.deferred:
                    self._release_deferred(request)
            else:
                if request.status == RequestStatus.RUNNING:
                    cache_blocks(request)  # before its blocks are freed, so a later prompt can reuse them
                out = self._finish(request, status)
                out.new_token_ids = [token]
                out.new_logprobs = new_logprobs
                append_out(out)
            if num_outputs == 1:
                self._first_delta_extras(request, out, runner_output.kv_exports)
        # After the tokens: a token that completes a block's ids lets it be cached now, not a step later.
        running = RequestStatus.RUNNING
        for request in step.values():
            if request.status == running:
                cache_blocks(request)
        return outputs

    def _first_delta_extras(self, request: Request, out: RequestOutput, kv_exports: dict[str, list] | None) -> None:
        """What rides on a request's first token's delta: its prompt logprobs, and the KV its step exported."""
        if request.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        if kv_exports is not None and request.request_id in kv_exports:
            out.kv_transfer = KVTransfer(
                first_block=request.kv_export_from_block,
                num_prompt_tokens=request.num_prompt_tokens,
                block_size=self.block_size,
                parts=kv_exports[request.request_id],
                token_ids=list(request.output_token_ids),
            )

    def _apply_other_results(self, step: dict[str, Request], runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """What a step computed besides sampled tokens: prompt logprobs (kept for the request's first token delta),
        embeddings, each of which finishes its request (returns those final outputs), and a draft model's proposals
        for each speculable request it sampled (kept for its next step)."""
        for req_id, draft_token_ids in (runner_output.draft_token_ids or {}).items():
            step[req_id].draft_token_ids = draft_token_ids
        for req_id, entries in (runner_output.prompt_logprobs or {}).items():
            request = step[req_id]
            if not request.is_finished:
                request.prompt_logprobs += entries
        outputs = []
        for req_id, embedding in (runner_output.pooled or {}).items():
            request = step[req_id]
            request.num_output_placeholders -= 1
            if request.status < RequestStatus.FINISHED_STOPPED:
                out = self._finish(request, RequestStatus.FINISHED_STOPPED)
                out.embedding = embedding
                outputs.append(out)
        return outputs

    def _apply_verified(
        self, request: Request, token: int, num_accepted: int, runner_output: ModelRunnerOutput, i: int
    ) -> RequestOutput | None:
        """A request's verified proposals: its computed count rolls back over the rejected ones, then the accepted
        ones and the sampled token are applied one by one, each checked against the stop rules (those after a stop
        are dropped). None when the request had finished before the step returned."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        self.speculation.record(len(drafts), num_accepted)
        if request.num_computed_tokens:  # 0: preempted by recompute meanwhile, nothing computed is left
            request.num_computed_tokens -= len(drafts) - num_accepted
        if request.is_finished:
            return None
        tokens = drafts[:num_accepted] + [token]
        entries = None
        if runner_output.logprobs is not None and runner_output.logprobs[i] is not None:
            entries = runner_output.accepted_logprobs[i] + [runner_output.logprobs[i]]
        status = None
        for j, t in enumerate(tokens):
            request.append_output_token(t)
            status = _stop_status(request, t, self.config.max_model_len)
            if status is not None:
                tokens = tokens[: j + 1]
                break
        entries = None if entries is None else entries[: len(tokens)]
        req_id = request.request_id
        if status is None:
            if self.deferred and req_id in self.deferred:
                self._release_deferred(request)
            out = RequestOutput(
                request_id=request.parent_id or req_id, index=request.index, new_token_ids=tokens, new_logprobs=entries
            )
        else:
            if request.status == RequestStatus.RUNNING:
                self.kv.cache_computed_blocks(request)
            out = self._finish(request, status)
            out.new_token_ids, out.new_logprobs = tokens, entries
        if request.sampling_params.prompt_logprobs is not None and len(request.output_token_ids) == len(tokens):
            out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        return out


def _stop_status(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    params = request.sampling_params
    num_out = len(request.output_token_ids)
    if num_out >= params.min_tokens:
        if token == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if num_out >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One sample's params: n becomes 1 and a seed is offset so the samples differ yet stay reproducible.

    The offset wraps modulo 2**64, staying in torch.Generator's seed range (where
    a negative seed already means seed + 2**64).
    """
    return dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + index) % 2**64)
