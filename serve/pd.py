"""Prefill/decode disaggregation, the serving side: the prefill deployment, and the engine the decode replica (the
LLMServer, the app's ingress) hands its requests to.

A request PD splits runs in four steps (PDEngine): the decode engine says how many of the prompt's leading blocks
its prefix cache holds; a prefill replica (prefix-cache routed, router.py) computes the prompt with max_tokens 1
and exports the KV of the blocks from there on; its one token goes to the client as the first delta; the decode
engine takes the KV and that token and streams the rest. Ray Serve LLM's PD app splits a request the same way.

Everything the deployment class uses is imported by module path, never defined after it (server.py says why).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from engine.client import EngineClient, engine_client, prompt_block_hashes
from scheduler import EngineRequest, KVTransferError, RequestError, RequestOutput, SchedulerStats, merge_deltas
from serve.metrics import publish_engine_stats, replica_metrics
from serve.options import AppArgs
from serve.router import HASHES_KWARG, replica_routing_stats

PREFILL_HEALTH_S = 10.0  # /health's wait for a prefill replica to answer: Serve holds the call while none is up


class PrefillUnavailable(RuntimeError):
    """No prefill replica computed the prompt, or its KV did not reach the decode engine, twice."""


@serve.deployment(name="PrefillServer")
class PrefillServer:
    """One prefill replica: an engine (its own tensor-parallel size) that computes prompts and exports their
    KV. It serves no HTTP; the decode replicas call ``prefill`` through a handle. Its engine's gauges and totals
    (queues, KV-cache usage, prefix-cache queries and hits, steps) go to Ray's metrics export under its own
    ``replica`` label, as a decode replica's do: what it serves (tokens, latencies) the decode replica counts."""

    async def __init__(self, args: AppArgs) -> None:
        self.engine = engine_client(args.engine, ray.util.get_current_placement_group(), first_bundle=1)
        self.metrics = replica_metrics(args.model_name, self.engine, args.engine)
        self._publisher = asyncio.get_running_loop().create_task(publish_engine_stats(self.metrics, self.engine))

    async def prefill(self, request: EngineRequest, block_hashes: list | None = None) -> RequestOutput:
        """``request`` (max_tokens 1, ``kv_export_from_block`` set) run to its end: its deltas folded into the
        final one, which carries the KV transfer. ``block_hashes`` are the request router's (router.py), unused
        here. Cancelled, it aborts the request in the engine."""
        return merge_deltas([out async for out in self.engine.generate(request)])[0]

    async def ready(self) -> None:
        """Raises when this replica's engine cannot serve (the decode replica's /health asks)."""
        await asyncio.to_thread(self.engine.check_health)

    async def stats(self) -> SchedulerStats:
        """This replica's engine's figures (prompts queried and found in its prefix cache, its queues)."""
        return await self.engine.get_stats()

    async def record_routing_stats(self) -> dict[str, Any]:
        return await replica_routing_stats(self.engine)

    async def check_health(self) -> None:
        await asyncio.to_thread(self.engine.check_health)


def splits(request: EngineRequest) -> bool:
    """Whether PD splits the request; the others run whole on the decode engine: several samples, one token,
    embeddings, a LoRA adapter (the prefill replicas hold none), a structured output (its grammar would have to
    follow the token sampled elsewhere)."""
    params = request.sampling_params
    return (
        params.n == 1
        and params.max_tokens > 1
        and params.pooling is None
        and params.structured_outputs is None
        and request.lora_name is None
    )


class PDEngine:
    """The decode replica's ``generate``: the request's prompt computed on a prefill replica, the rest decoded on
    ``decode`` (this replica's engine), as one stream of deltas equal to the unified engine's (greedy: the same
    tokens and logprobs; the usage's cached tokens are the decode engine's prefix hit, as unified).

    Invariants: a failed prefill (its replica died) or a KV transfer that did not arrive is retried once, then the
    stream raises PrefillUnavailable; the prompt's first token streams once, whichever attempt's KV is used (the KV
    does not depend on the sampled token); closing the stream aborts the request wherever it runs. ``prefilling``
    holds the prefill calls in flight, which ``end_callers`` cancels.
    """

    def __init__(self, decode: EngineClient, prefill: DeploymentHandle) -> None:
        self.decode = decode
        self.prefill = prefill
        self.block_size = decode.config.block_size
        self.prefilling: set[DeploymentResponse] = set()
        self.ending: BaseException | None = None

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """As EngineClient.generate: a RequestError is raised by this call, before any stream exists."""
        if not splits(request):
            return self.decode.generate(request)
        self.decode.check_request(request)
        return self._split(request)

    def end_callers(self, error: BaseException) -> int:
        """End every stream by raising ``error`` in it (EngineClient.end_callers), those still prefilling too."""
        self.ending = error
        for response in self.prefilling:
            response.cancel()
        return len(self.prefilling) + self.decode.end_callers(error)

    async def check_prefill(self) -> None:
        """Raise RuntimeError unless a prefill replica answers that its engine serves."""
        try:
            await asyncio.wait_for(self.prefill.ready.remote(), PREFILL_HEALTH_S)
        except TimeoutError:
            raise RuntimeError(f"no prefill replica answered within {PREFILL_HEALTH_S:g} s") from None
        except Exception as e:
            raise RuntimeError(f"no prefill replica serves: {type(e).__name__}: {e}") from None

    async def _split(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        params = request.sampling_params
        hit = await self.decode.prefix_hit_blocks(request)
        prefill_request = dataclasses.replace(
            request,
            sampling_params=dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
            kv_export_from_block=hit,
        )
        hashes = prompt_block_hashes(request, self.block_size)
        first = await self._prefill(prefill_request, hashes)
        if first.finish_reason != "length":  # a stop token or an error: the whole answer, as the unified engine's
            yield dataclasses.replace(first, kv_transfer=None, num_cached_tokens=hit * self.block_size)
            return
        yield dataclasses.replace(
            first, finished=False, finish_reason=None, kv_transfer=None, num_cached_tokens=0, queued_s=None
        )
        decode_params = dataclasses.replace(params, prompt_logprobs=None)
        transfer = first.kv_transfer
        for attempt in (1, 2):
            decode_request = dataclasses.replace(request, sampling_params=decode_params, kv_transfer=transfer)
            async with aclosing(self.decode.generate(decode_request)) as stream:
                try:
                    out = await anext(stream, None)
                except KVTransferError as e:
                    if attempt == 2:
                        raise PrefillUnavailable(
                            f"the prompt's KV did not reach the decode engine twice: {e}"
                        ) from None
                    retry = await self._prefill(prefill_request, hashes)
                    if retry.kv_transfer is None:  # it failed in the engine: nothing to decode from
                        raise PrefillUnavailable(
                            f"the prompt's KV was lost ({e}), and its prefill again: {retry.error}"
                        ) from None
                    transfer = dataclasses.replace(retry.kv_transfer, token_ids=first.kv_transfer.token_ids)
                    continue
                while out is not None:
                    yield out
                    out = await anext(stream, None)
                return

    async def _prefill(self, request: EngineRequest, hashes: list) -> RequestOutput:
        """The prompt computed on a prefill replica (again, if that fails: Serve's router leaves a dead replica
        out), its final delta."""
        for attempt in (1, 2):
            try:
                return await self._prefill_once(request, hashes, attempt)
            except RequestError:
                raise
            except Exception as e:  # the replica died, or its engine failed
                if self.ending is not None:
                    raise self.ending from None
                failure = e
        raise PrefillUnavailable(
            f"no prefill replica computed the prompt (tried twice): {type(failure).__name__}: {failure}"
        )

    async def _prefill_once(self, request: EngineRequest, hashes: list, attempt: int) -> RequestOutput:
        # Its own id per attempt: a replica still running the first attempt would refuse a second of that id.
        response = self.prefill.prefill.remote(
            dataclasses.replace(request, request_id=f"{request.request_id}-prefill{attempt}"), **{HASHES_KWARG: hashes}
        )
        self.prefilling.add(response)
        try:
            return await response
        except asyncio.CancelledError:  # awaiting a response does not cancel the call when cancelled
            response.cancel()
            raise
        finally:
            self.prefilling.discard(response)
