"""One request driven through the engine: its deltas turned into text pieces, its samples finished once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.client import EngineStopping
from engine.output import SampleOutput
from scheduler import EngineRequest, RequestError, RequestOutput, SampledLogprobs, SamplingParams
from serve.metrics import ServeMetrics
from serve.protocol.output import PromptTokensDetails, Usage, new_id
from serve.protocol.parsing import APIError
from serve.protocol.sampling import SamplingFields


@dataclass(slots=True)
class Sample:
    """One of a request's ``n`` choices: its output (token ids, text, how it ended: set exactly once, by the
    engine's output path or here for an abort or a failure) and what the server adds to it."""

    output: SampleOutput
    first_token_time: float | None = None
    last_token_time: float | None = None
    error: APIError | None = None
    prompt_logprobs: list[SampledLogprobs] | None = None  # prompt tokens 1.., when asked

    @property
    def token_ids(self) -> list[int]:
        return self.output.token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason


@dataclass(slots=True)
class Piece:
    """What one engine delta adds to one choice: text already detokenized and cut at stop strings."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampledLogprobs] | None
    finish_reason: str | None
    error: APIError | None = None  # what the client gets for an "error" finish
    prompt_logprobs: list[SampledLogprobs] | None = None  # on a choice's first piece, when asked


def engine_unavailable(message: str) -> APIError:
    """An engine that failed or cannot take work: 503, since Serve replaces it and a retry may succeed."""
    return APIError(503, message, code="engine_unavailable")


def engine_error(e: Exception, what: str) -> APIError:
    """The 503 for an engine stream that raised: its replica draining (serve/drain.py), else a failure."""
    if isinstance(e, EngineStopping):
        return APIError(503, str(e), code="replica_shutting_down")
    return engine_unavailable(f"{what}: {type(e).__name__}: {e}")


class Generation:
    """One request driven through the engine, its deltas turned into Pieces.

    Invariants: every sample finishes once (EOS / length / error from the
    engine, or a stop string matched here, after which its late tokens are
    dropped); when all have finished, or the consumer goes away (a client
    disconnect cancels it), the engine stream is closed, which aborts what
    still runs there and frees its KV blocks; metrics count each sample once.
    An engine failure ends the unfinished samples with a 503 (the engine is
    unhealthy and Serve replaces it: retry), and one past ``timeout_s`` (from
    arrival, queueing included) with a 504, aborting it in the engine.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        metrics: ServeMetrics,
        prompt_ids: list[int],
        params: SamplingParams,
        req: SamplingFields,
        timeout_s: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.metrics = metrics
        self.prompt_ids = prompt_ids
        self.samples = [Sample(SampleOutput(tokenizer, prompt_ids, params)) for _ in range(params.n)]
        self.arrival = time.monotonic()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        self.num_cached_tokens = 0
        self.queued_s: float | None = None  # the scheduler's, from the first sample that finishes
        self.stream = engine.generate(
            EngineRequest(
                request_id=new_id("req"),
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                priority=req.priority,
                cache_salt=req.cache_salt,
                lora_name=lora_name,
            )
        )
        self.first: RequestOutput | None = None

    async def start(self) -> Generation:
        """Wait for the first delta, so that a request the engine refuses (RequestError, raised to the caller)
        fails before any response starts."""
        try:
            self.first = await self._next()
        except RequestError:
            raise
        except TimeoutError:
            await self.stream.aclose()
            raise self._timed_out() from None
        except Exception as e:  # the engine's actors are gone or refuse work, or the replica is draining
            raise engine_error(e, "the engine cannot take requests") from None
        self.metrics.prompt_tokens.inc(len(self.prompt_ids))
        self.metrics.prompt_hist.observe(len(self.prompt_ids))
        return self

    async def pieces(self) -> AsyncIterator[list[Piece]]:
        try:
            out = self.first
            while out is not None:
                yield self._absorb(out)
                if all(s.finish_reason for s in self.samples):
                    break
                out = await self._next()
        except Exception as e:
            self._end_unfinished(
                "error", self._timed_out() if isinstance(e, TimeoutError) else engine_error(e, "the engine failed")
            )
            yield [Piece(i, "", [], None, "error", s.error) for i, s in enumerate(self.samples) if s.error]
        finally:
            await self.stream.aclose()  # aborts in the engine whatever has not finished there
            self._end_unfinished("abort")

    async def _next(self) -> RequestOutput | None:
        """The next delta (None once the stream ends); TimeoutError past the deadline, which cancels the wait
        inside the engine's stream (so it aborts the request there)."""
        async with asyncio.timeout_at(self.deadline):
            return await anext(self.stream, None)

    def _timed_out(self) -> APIError:
        return APIError(
            504,
            f"the request did not finish within this server's request_timeout_s={self.timeout_s:g} s; it was aborted",
            code="request_timeout",
        )

    def _absorb(self, out: RequestOutput) -> list[Piece]:
        s = self.samples[out.index]
        if s.finish_reason is not None:
            return []
        t = time.monotonic()
        if out.new_token_ids:
            if s.first_token_time is None:
                s.first_token_time = t
            else:
                self.metrics.itl.observe((t - s.last_token_time) / len(out.new_token_ids))
            s.last_token_time = t
            # Inside the branch: Ray's counters refuse an increment of 0, and a final delta without tokens (an
            # error, an abort) must reach the caller as itself, not as that refusal.
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.prompt_logprobs is not None:
            s.prompt_logprobs = out.prompt_logprobs
        text = s.output.add(out.new_token_ids, out.finish_reason if out.finished else None)
        if out.finished:
            if out.error is not None and s.finish_reason == "error":
                s.error = engine_unavailable(f"the engine failed: {out.error}")
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            self.queued_s = out.queued_s if self.queued_s is None else self.queued_s
        if s.finish_reason is not None:
            self.metrics.finished(s.finish_reason, len(s.token_ids), self.arrival, s.first_token_time, t, self.queued_s)
        return [
            Piece(out.index, text, out.new_token_ids, out.new_logprobs, s.finish_reason, s.error, out.prompt_logprobs)
        ]

    def _end_unfinished(self, reason: str, error: APIError | None = None) -> None:
        for s in self.samples:
            if s.finish_reason is None:
                s.output.finish_reason, s.error = reason, error
                self.metrics.finished(
                    reason, len(s.token_ids), self.arrival, s.first_token_time, time.monotonic(), self.queued_s
                )

    def usage(self) -> Usage:
        completion = sum(len(s.token_ids) for s in self.samples)
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=completion,
            total_tokens=len(self.prompt_ids) + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )
