"""The Ray Serve application: an OpenAI-compatible HTTP API (FastAPI ingress) and a gRPC service, each
replica owning one RayEngine. ``build_app`` is importable by path (``cluster.serve:build_app``) for
``serve run`` / ``serve deploy``; ``raylm serve`` calls ``start``."""

import asyncio
import hmac
import json
import os
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext
from starlette.exceptions import HTTPException
from transformers import AutoTokenizer

from cluster.config import EngineConfig
from cluster.detokenize import TextStream
from cluster.metrics import CONTENT_TYPE, ServeMetrics
from cluster.protocol import (
    APIError, AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, ChatMessage, ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs,
    CompletionRequest, CompletionResponse, Delta, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    PromptTokensDetails, SamplingFields, TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse,
    TokenLogprob, TopLogprob, Usage, bad_request, new_id, now, parse,
)
from cluster.ray_engine import RayEngine, connect, engine_bundles, resolve_device
from cluster.raylm_pb2 import GenerateRequest, GenerateResponse
from scheduler import RequestOutput, SampledLogprobs, SamplingParams

APP_NAME = "raylm"
GRPC_SERVICER = "cluster.raylm_pb2_grpc.add_RayLMServicer_to_server"
REPLICA_CPUS = 1.0  # the replica tokenizes, detokenizes and formats every token it streams
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # workers.default_model.MODEL_NAME, without importing torch here
GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              404: grpc.StatusCode.NOT_FOUND, 503: grpc.StatusCode.UNAVAILABLE}


class AppArgs(BaseModel):
    """What ``build_app`` takes: an EngineConfig plus the serving knobs.

    Autoscaling defaults suit an engine that batches: a replica runs up to
    ``max_num_seqs`` requests at once, so it is sent that many
    (``max_ongoing_requests``) and scales out when it averages half of that
    (``target_ongoing_requests``); Serve's defaults (5 and 2) would starve
    the batch.
    """

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str | None = None
    api_key: str | None = None
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)

    @classmethod
    def from_flat(cls, args: dict[str, Any]) -> "AppArgs":
        """From one flat mapping (``serve run ... key=value``, a Serve config's ``args``): EngineConfig's
        fields go to the engine, the rest are the serving knobs."""
        engine = {k: v for k, v in args.items() if k in EngineConfig.model_fields}
        return cls(engine=EngineConfig(**engine), **{k: v for k, v in args.items() if k not in engine})

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model or DEFAULT_MODEL_NAME


def deployment_options(args: AppArgs) -> dict[str, Any]:
    """Each replica reserves its own bundle plus its engine's (scheduler, one per rank) in one placement group,
    so Serve only starts a replica, or scales up, where the whole engine fits."""
    cfg = args.engine
    use_gpu = resolve_device(cfg.device) == "cuda" if ray.is_initialized() else cfg.device == "cuda"
    return dict(
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        placement_group_bundles=[{"CPU": REPLICA_CPUS}] + engine_bundles(cfg, use_gpu),
        placement_group_strategy=cfg.placement_strategy,
        max_ongoing_requests=args.max_ongoing_requests or cfg.max_num_seqs,
        autoscaling_config={
            "min_replicas": args.min_replicas, "initial_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests or max(1, cfg.max_num_seqs // 2),
        },
    )


# ---- one request through the engine ----------------------------------------------------


@dataclass(slots=True)
class Sample:
    """One of a request's ``n`` choices: its text so far and how it ended (set exactly once)."""

    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(slots=True)
class Piece:
    """What one engine delta adds to one choice: text already detokenized and cut at stop strings."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampledLogprobs] | None
    finish_reason: str | None
    error: str | None = None


class Generation:
    """One request driven through the engine, its deltas turned into Pieces.

    Invariants: every sample finishes once (EOS / length / error from the
    engine, or a stop string matched here, after which its late tokens are
    dropped); when all have finished, or the consumer goes away (a client
    disconnect cancels it), the engine stream is closed, which aborts what
    still runs there and frees its KV blocks; metrics count each sample once.
    """

    def __init__(self, server: "LLMServer", prompt_ids: list[int], params: SamplingParams, req: SamplingFields) -> None:
        self.server = server
        self.prompt_ids = prompt_ids
        tok = server.tokenizer
        self.samples = [Sample(TextStream(tok, prompt_ids, req.stop_strings, req.skip_special_tokens))
                        for _ in range(params.n)]
        self.arrival = time.monotonic()
        self.num_cached_tokens = 0
        self.stream = server.engine.generate(new_id("req"), prompt_ids, params, req.priority)
        self.first: RequestOutput | None = None

    async def start(self) -> "Generation":
        """Wait for the first delta, so that a request the engine refuses fails before any response starts."""
        try:
            self.first = await anext(self.stream)
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        except Exception as e:  # the engine's actors are gone or refuse work
            raise APIError(503, f"the engine cannot take requests: {e}", code="engine_unavailable") from None
        self.server.metrics.prompt_tokens.inc(len(self.prompt_ids))
        return self

    async def pieces(self) -> AsyncIterator[list[Piece]]:
        try:
            out = self.first
            while out is not None:
                yield self._absorb(out)
                if all(s.finish_reason for s in self.samples):
                    break
                out = await anext(self.stream, None)
        except Exception as e:
            self._end_unfinished("error", f"the engine failed: {type(e).__name__}: {e}")
            yield [Piece(i, "", [], None, "error", s.error) for i, s in enumerate(self.samples)]
        finally:
            await self.stream.aclose()  # aborts in the engine whatever has not finished there
            self._end_unfinished("abort")

    def _absorb(self, out: RequestOutput) -> list[Piece]:
        s = self.samples[out.index]
        if s.finish_reason is not None:
            return []
        t = time.monotonic()
        if out.new_token_ids and s.first_token_time is None:
            s.first_token_time = t
        s.token_ids += out.new_token_ids
        self.server.metrics.generation_tokens.inc(len(out.new_token_ids))
        text = s.text.add(out.new_token_ids)
        if s.text.stopped:
            s.finish_reason = "stop"
        elif out.finished:
            s.finish_reason, s.error = out.finish_reason, out.error
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            text += s.text.finish()
        if s.finish_reason is not None:
            self.server.metrics.finished(s.finish_reason, len(s.token_ids), self.arrival, s.first_token_time, t)
        return [Piece(out.index, text, out.new_token_ids, out.new_logprobs, s.finish_reason, s.error)]

    def _end_unfinished(self, reason: str, error: str | None = None) -> None:
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason, s.error = reason, error
                self.server.metrics.finished(reason, len(s.token_ids), self.arrival, s.first_token_time,
                                             time.monotonic())

    def usage(self) -> Usage:
        completion = sum(len(s.token_ids) for s in self.samples)
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=completion,
                     total_tokens=len(self.prompt_ids) + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens))


# ---- response formats -------------------------------------------------------------------


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


@dataclass(slots=True)
class CompletionFormat:
    """Builds /v1/completions chunks and responses; ``offsets`` keeps each choice's logprob text_offset."""

    tokenizer: Any
    id: str
    model: str
    num_logprobs: int | None
    offsets: dict[int, int] = field(default_factory=dict)
    created: int = field(default_factory=now)

    def opening(self, n: int, usage: bool) -> list[BaseModel]:
        return []

    def logprobs(self, p: Piece) -> CompletionLogprobs | None:
        """Offsets index the returned text: a token decoded alone can show half a character as U+FFFD, or
        text a stop string cut, so each advances by its own text but never past what its piece added."""
        if self.num_logprobs is None or not p.logprobs:
            return None
        out, offset = CompletionLogprobs(), self.offsets.get(p.index, 0)
        end = offset + len(p.text)
        for token_id, lp in zip(p.token_ids, p.logprobs):
            token = _token_str(self.tokenizer, token_id)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.text_offset.append(offset)
            out.top_logprobs.append({_token_str(self.tokenizer, t): v
                                     for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
            offset = min(offset + len(token), end)
        self.offsets[p.index] = end
        return out

    def chunk(self, pieces: list[Piece], usage: bool) -> BaseModel:
        choices = [CompletionChoice(index=p.index, text=p.text, logprobs=self.logprobs(p),
                                    finish_reason=p.finish_reason) for p in pieces]
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                               **({"usage": None} if usage else {}))

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, gen: Generation, texts: list[str], logprobs: list[list[BaseModel]]) -> BaseModel:
        choices = [CompletionChoice(index=i, text=t, finish_reason=s.finish_reason,
                                    logprobs=_merge_completion_logprobs(lps) if self.num_logprobs is not None
                                    else None)
                   for i, (s, t, lps) in enumerate(zip(gen.samples, texts, logprobs))]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=gen.usage())


def _merge_completion_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for p in parts:
        out.tokens += p.tokens
        out.token_logprobs += p.token_logprobs
        out.text_offset += p.text_offset
        out.top_logprobs += p.top_logprobs
    return out


@dataclass(slots=True)
class ChatFormat:
    """Builds /v1/chat/completions chunks and responses (the role comes once per choice, first)."""

    tokenizer: Any
    id: str
    model: str
    num_logprobs: int | None
    created: int = field(default_factory=now)

    def opening(self, n: int, usage: bool) -> list[BaseModel]:
        return [ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            ChatStreamChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(n)],
            **({"usage": None} if usage else {}))]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = _token_str(self.tokenizer, token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    def logprobs(self, p: Piece) -> ChatLogprobs | None:
        if self.num_logprobs is None or not p.logprobs:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(**self._top(t, lp.logprob).model_dump(),
                         top_logprobs=[self._top(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)])
            for t, lp in zip(p.token_ids, p.logprobs)])

    def chunk(self, pieces: list[Piece], usage: bool) -> BaseModel:
        choices = [ChatStreamChoice(index=p.index, delta=Delta(content=p.text or None), logprobs=self.logprobs(p),
                                    finish_reason=p.finish_reason) for p in pieces]
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   **({"usage": None} if usage else {}))

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, gen: Generation, texts: list[str], logprobs: list[list[BaseModel]]) -> BaseModel:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=t), finish_reason=s.finish_reason,
                              logprobs=ChatLogprobs(content=[c for lp in lps for c in lp.content])
                              if self.num_logprobs is not None else None)
                   for i, (s, t, lps) in enumerate(zip(gen.samples, texts, logprobs))]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=gen.usage())


Format = CompletionFormat | ChatFormat


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def stream_sse(gen: Generation, fmt: Format, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: ``data: {chunk}`` per delta, an error event if the engine fails, then [DONE]."""
    for chunk in fmt.opening(len(gen.samples), include_usage):
        yield _sse(chunk)
    async with aclosing(gen.pieces()) as stream:
        async for pieces in stream:
            pieces = [p for p in pieces if p.text or p.finish_reason or p.logprobs]
            errors = [p.error or "the engine failed" for p in pieces if p.finish_reason == "error"]
            if errors:
                yield _sse(APIError(500, errors[0]).body())
                break
            if pieces:
                yield _sse(fmt.chunk(pieces, include_usage))
        else:
            if include_usage:
                yield _sse(fmt.usage_chunk(gen.usage()))
    yield "data: [DONE]\n\n"


async def collect(gen: Generation, fmt: Format) -> BaseModel:
    n = len(gen.samples)
    texts, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    async with aclosing(gen.pieces()) as stream:
        async for pieces in stream:
            for p in pieces:
                if p.finish_reason == "error":
                    raise APIError(500, p.error or "the engine failed")
                texts[p.index].append(p.text)
                if (lp := fmt.logprobs(p)) is not None:
                    logprobs[p.index].append(lp)
    return fmt.response(gen, ["".join(t) for t in texts], logprobs)


# ---- HTTP plumbing -----------------------------------------------------------------------


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


async def read_json(request: Request, limit: int) -> Any:
    """The decoded body, refused (413) once it passes ``limit`` bytes, before anything parses it."""
    too_large = APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_large
    try:
        return json.loads(body)
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise bad_request("the body is nested too deeply to decode as JSON", code="invalid_json") from None


# Everything the deployment class uses is defined above it: Serve pickles the class by value while this
# module is still being imported, so a helper defined below it would be missing in the replica.


def _grpc_check(p: Piece) -> None:
    if p.finish_reason == "error":
        raise APIError(500, p.error or "the engine failed")


def _grpc_abort(context: RayServegRPCContext, e: APIError) -> None:
    context.set_code(GRPC_CODES.get(e.status, grpc.StatusCode.INTERNAL))
    context.set_details(f"{e.param}: {e.message}" if e.param and not e.message.startswith(e.param) else e.message)


app = FastAPI(title="raylm", description="OpenAI-compatible LLM serving on Ray")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> Response:
    return json_response(e.body(), e.status)


@app.exception_handler(HTTPException)
async def _http_error(_: Request, e: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return json_response(APIError(e.status_code, str(e.detail), code=code).body(), e.status_code)


@app.exception_handler(Exception)
async def _internal_error(_: Request, e: Exception) -> Response:
    return json_response(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), 500)


@serve.deployment(name="LLMServer")
@serve.ingress(app)
class LLMServer:
    """One replica: a RayEngine, the tokenizer, and this replica's metrics.

    Every request is validated (400 naming the parameter), sized against the
    context and the KV cache, and tokenized here before it reaches the engine,
    so the engine only sees requests it can run; the API key (when set) guards
    everything but /health.
    """

    def __init__(self, args: AppArgs) -> None:
        self.engine = RayEngine(args.engine, placement_group=ray.util.get_current_placement_group(), first_bundle=1)
        self.tokenizer = AutoTokenizer.from_pretrained(args.engine.tokenizer or self.engine.model_path)
        self.model_name = args.model_name
        self.api_key = args.api_key
        self.max_body_bytes = args.max_body_bytes
        self.scheduling_policy = args.engine.scheduling_policy
        self.metrics = ServeMetrics(self.model_name)
        self.created = now()
        cfg = args.engine
        # The longest sequence (prompt + output) one request may reach: the context, or the whole KV cache
        # (less block 0, the scheduler's null block). Longer ones are refused here with a 400 naming max_tokens.
        self.max_seq_len = min(self.engine.max_model_len, (self.engine.num_blocks - 1) * cfg.block_size)

    async def check_health(self) -> None:
        """Serve's periodic check: raising restarts this replica (and so its engine)."""
        await asyncio.to_thread(self.engine.check_health)

    # ---- validation helpers ----

    def _authorize(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        given = (authorization or "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        self._authorize(request.headers.get("authorization"))
        return await read_json(request, self.max_body_bytes)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        try:
            return list(self.tokenizer.apply_chat_template(
                [m.template_dict() for m in messages], add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False))
        except Exception as e:  # templates raise on what they cannot render (roles out of order, ...)
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids as they are: the engine rejects an empty prompt or ids outside the vocabulary (a 400)."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    def _max_tokens(self, num_prompt: int, requested: int | None, param: str, prompt_param: str) -> int:
        """The request's max_tokens (by default all the room left), or 400 if the sequence cannot fit."""
        room = self.max_seq_len - num_prompt
        limit = (f"this server's limit is {self.max_seq_len} tokens per sequence (prompt + output; "
                 f"max_model_len={self.engine.max_model_len})")
        if room < 1:
            raise bad_request(f"the prompt has {num_prompt} tokens: {limit}", prompt_param, "context_length_exceeded")
        if requested is not None and requested > room:
            raise bad_request(f"{param}={requested} with a {num_prompt}-token prompt is too long: {limit}", param,
                              "context_length_exceeded")
        return requested or room

    async def _generation(self, req: SamplingFields, prompt_ids: list[int], max_tokens: int,
                          num_logprobs: int | None) -> Generation:
        # Under fcfs the scheduler ignores priority: refuse it rather than silently not honour it, as vLLM does.
        if req.priority != 0 and self.scheduling_policy != "priority":
            raise bad_request(f"priority={req.priority} needs the priority scheduling policy; this server schedules "
                              f"{self.scheduling_policy} (serve with scheduling_policy=priority)", "priority")
        return await Generation(self, prompt_ids, req.sampling_params(max_tokens, num_logprobs), req).start()

    async def _run(self, req: SamplingFields, prompt_ids: list[int], max_tokens: int, num_logprobs: int | None,
                   fmt_type: Callable[..., Format], prefix: str) -> Response:
        gen = await self._generation(req, prompt_ids, max_tokens, num_logprobs)
        fmt = fmt_type(self.tokenizer, new_id(prefix), self.model_name, num_logprobs)
        if req.stream:
            return StreamingResponse(stream_sse(gen, fmt, req.include_usage), media_type="text/event-stream")
        return json_response(await collect(gen, fmt))

    # ---- OpenAI endpoints ----

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await self._body(request))
        self._check_model(req.model)
        ids = self._prompt_ids(req.single_prompt())
        max_tokens = self._max_tokens(len(ids), req.max_tokens, "max_tokens", "prompt")
        return await self._run(req, ids, max_tokens, req.logprobs, CompletionFormat, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await self._body(request))
        self._check_model(req.model)
        num_logprobs = req.num_logprobs
        ids = self._chat_ids(req.messages, req.add_generation_prompt)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(len(ids), req.requested_max_tokens, param, "messages")
        return await self._run(req, ids, max_tokens, num_logprobs, ChatFormat, "chatcmpl")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request.headers.get("authorization"))
        return json_response(ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                                       root=self.engine.model_path,
                                                       max_model_len=self.engine.max_model_len)]))

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        is_chat = isinstance(body, dict) and "messages" in body
        req = parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)
        self._check_model(req.model)
        ids = (self._chat_ids(req.messages, req.add_generation_prompt) if is_chat
               else self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return json_response(TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids))

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        req = parse(DetokenizeRequest, await self._body(request))
        self._check_model(req.model)
        vocab = len(self.tokenizer)
        if bad := next((t for t in req.tokens if t >= vocab), None):
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return json_response(DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)))

    # ---- operations ----

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.to_thread(self.engine.check_health)
        except Exception as e:
            return json_response(APIError(503, f"the engine is unhealthy: {e}", code="engine_unhealthy").body(), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._authorize(request.headers.get("authorization"))
        stats = await asyncio.to_thread(self.engine.stats)
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE)

    # ---- gRPC (method names are the .proto's) ----

    async def _grpc_generation(self, request: GenerateRequest, context: RayServegRPCContext) -> Generation:
        self._authorize(dict(context.invocation_metadata()).get("authorization"))
        body = MessageToDict(request, preserving_proto_field_name=True)  # only the fields that are set
        body["prompt"] = body.pop("prompt_token_ids", None) or request.prompt
        req = parse(CompletionRequest, body)
        self._check_model(req.model or None)
        ids = self._prompt_ids(req.single_prompt())
        max_tokens = self._max_tokens(len(ids), req.max_tokens, "max_tokens", "prompt")
        return await self._generation(req, ids, max_tokens, None)

    async def Generate(self, request: GenerateRequest, grpc_context: RayServegRPCContext) -> GenerateResponse:
        reply = GenerateResponse()
        try:
            gen = await self._grpc_generation(request, grpc_context)
            async with aclosing(gen.pieces()) as stream:
                async for pieces in stream:
                    for p in pieces:
                        _grpc_check(p)
                        reply.text += p.text
                        reply.token_ids.extend(p.token_ids)
                        reply.finish_reason = p.finish_reason or ""
        except APIError as e:
            _grpc_abort(grpc_context, e)
            return GenerateResponse()
        reply.num_prompt_tokens, reply.num_generated_tokens = len(gen.prompt_ids), len(reply.token_ids)
        return reply

    async def GenerateStream(self, request: GenerateRequest,
                             grpc_context: RayServegRPCContext) -> AsyncIterator[GenerateResponse]:
        try:
            gen = await self._grpc_generation(request, grpc_context)
            sample = gen.samples[0]
            async with aclosing(gen.pieces()) as stream:
                async for pieces in stream:
                    for p in pieces:
                        _grpc_check(p)
                        yield GenerateResponse(text=p.text, token_ids=p.token_ids,
                                               finish_reason=p.finish_reason or "",
                                               num_prompt_tokens=len(gen.prompt_ids),
                                               num_generated_tokens=len(sample.token_ids))
        except APIError as e:
            _grpc_abort(grpc_context, e)
            raise  # a streaming call ends with the status set only when it raises


# ---- building and starting -----------------------------------------------------------------


def build_app(args: dict[str, Any] | AppArgs) -> serve.Application:
    """The application, from ``serve run cluster.serve:build_app model=PATH max_replicas=4`` (or a Serve config's
    ``args``, or ``raylm serve``). The API key is ``api_key`` or else $RAYLM_API_KEY."""
    app_args = args if isinstance(args, AppArgs) else AppArgs.from_flat(args)
    if app_args.api_key is None and os.environ.get("RAYLM_API_KEY"):
        app_args = app_args.model_copy(update={"api_key": os.environ["RAYLM_API_KEY"]})
    return LLMServer.options(**deployment_options(app_args)).bind(app_args)


def start(args: AppArgs, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          grpc_port: int = 9000, timeout_s: float = 900.0) -> str:
    """Start or join Ray, deploy the app with Serve's HTTP and gRPC proxies, and return the URL once /health answers."""
    cfg = args.engine
    # A local Ray gets logical CPUs for every replica's reservations (engine_bundles plus the replica's own).
    connect(address, args.max_replicas * (REPLICA_CPUS + sum(b.get("CPU", 0) for b in engine_bundles(cfg, False))))
    serve.start(http_options={"host": host, "port": port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    wait_healthy(url, timeout_s)
    return url


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(0.5)


def serve_until_interrupted(args: AppArgs, *, address: str | None, host: str, port: int, grpc_port: int) -> None:
    """`raylm serve`: deploy, print where, and keep serving until Ctrl-C (which deletes the app)."""
    # A process manager's stop (SIGTERM), or Ctrl-C from a shell that started us in the background, is a Ctrl-C.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    url = start(args, address=address, host=host, port=port, grpc_port=grpc_port)
    print(f"raylm: serving {args.model_name} at {url}/v1 (OpenAI API) and gRPC on port {grpc_port}; "
          f"Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(APP_NAME)
