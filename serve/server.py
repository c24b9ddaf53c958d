"""The replica: the OpenAI routes, /tokenize and /detokenize, health and metrics, and the gRPC methods.

Everything the deployment class uses is imported by module path (the replica imports the installed
package), never defined after the class: Serve pickles the class by value.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) through Serve's
# wrappers, whose globals are not this module's, so they must be objects, not strings.

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import ray
from fastapi import Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from engine.client import engine_client
from engine.model_files import (
    generation_defaults,
    load_tokenizer,
    not_an_embedding_model,
    pooling_type,
    serves_embeddings,
)
from scheduler import RequestError, SamplingParams
from serve import grpc_replies
from serve.admission import Admission
from serve.controls import Controls, common, json_reply, pause_mode, per_replica, sleep_level, wake_tags
from serve.drain import CODE as DRAIN_CODE
from serve.drain import Drain
from serve.embeddings import embed, embedding_prompts
from serve.formats import ChatFormat, CompletionFormat, Format, collect, stream_sse
from serve.generation import Generation
from serve.grpc_replies import completion_body
from serve.http_app import app
from serve.http_io import asgi_messages, json_response, read_json
from serve.metrics import (
    CONTENT_TYPE,
    node_metrics_port,
    publish_engine_stats,
    render_node_metrics,
    replica_metrics,
)
from serve.openapi import openapi_schema
from serve.options import AppArgs
from serve.pd import PDEngine
from serve.prompts import chat_ids, chat_request_ids, prompt_ids
from serve.protocol.chat import ChatCompletionRequest
from serve.protocol.completions import CompletionRequest
from serve.protocol.controls import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)
from serve.protocol.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, encoded
from serve.protocol.models import (
    LoadLoraAdapterRequest,
    ModelList,
    UnloadLoraAdapterRequest,
)
from serve.protocol.output import new_id, now
from serve.protocol.parsing import APIError, bad_request, parse
from serve.protocol.responses import ResponsesRequest, responses_error
from serve.protocol.sampling import SamplingFields
from serve.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from serve.raylm_pb2 import GenerateRequest, GenerateResponse
from serve.response_store import ResponseStore
from serve.responses import ResponsesRun
from serve.router import replica_routing_stats
from serve.served_models import ServedModels
from serve.tools import ToolCalling


@serve.deployment(name="LLMServer")
@serve.ingress(app)
class LLMServer:
    """One replica: its engine (engine/client.py's EngineClient), the tokenizer, and this replica's metrics.

    Every request is parsed (400 naming the parameter), sized against the
    context and the KV cache, and tokenized here; the engine's check of it
    (engine/request_check.py) is a 400 naming the parameter too,
    before any response starts; the API key (when set) guards
    everything but /health. Admission bounds the requests it holds (429 past
    that) and ``request_timeout_s`` how long each may take (504); once Serve stops the replica, Drain
    refuses new requests and ends those still running after ``drain_timeout_s`` (503). Given the ``prefill``
    deployment (``pd``), its engine decodes and the prompts it splits are computed there (serve/pd.py).
    """

    async def __init__(self, args: AppArgs, prefill: DeploymentHandle | None = None) -> None:
        self.engine = engine_client(args.engine, ray.util.get_current_placement_group(), first_bundle=1)
        self.pd = PDEngine(self.engine, prefill) if prefill is not None else None
        self.tokenizer = load_tokenizer(args.engine, self.engine.model_path)
        self.sampling_defaults = generation_defaults(args.engine, self.engine.model_path)
        self.model_name = args.model_name
        self.served = ServedModels(
            self.model_name, self.engine.model_path, self.engine.max_model_len, args.engine.lora_paths, now()
        )
        self.api_key = args.api_key
        self.max_body_bytes = args.max_body_bytes
        self.scheduling_policy = args.engine.scheduling_policy
        self.close_objects = args.engine.structured_outputs_disable_additional_properties
        self.response_store = ResponseStore(args.responses_store_max_entries, args.responses_store_ttl_s)
        cfg = args.engine
        self.pooling_type = pooling_type(cfg.pooling_type, self.engine.model_path)
        self.serves_embeddings = serves_embeddings(cfg.runner, self.engine.model_path)
        self.metrics = replica_metrics(self.model_name, self.engine, cfg)
        self.admission = Admission(self.pd or self.engine, cfg.max_num_seqs + args.queue_len, self.metrics.rejected.inc)
        self.request_timeout_s = args.request_timeout_s
        self.drain = Drain(self.admission, args.drain_timeout_s)
        self._drainer = asyncio.get_running_loop().create_task(self.drain.watch())
        self.metrics_port = node_metrics_port()
        self._publisher = asyncio.get_running_loop().create_task(publish_engine_stats(self.metrics, self.engine))
        # The longest sequence (prompt + output) one request may reach: the context, or the whole KV cache
        # (less block 0, the scheduler's null block). Longer ones are refused here with a 400 naming max_tokens.
        self.max_seq_len = min(self.engine.max_model_len, (self.engine.num_blocks - 1) * cfg.block_size)
        if cfg.enable_lora:  # before serving: the engine then holds every adapter loaded at run time so far
            await self.served.join(serve.get_replica_context().replica_id.unique_id, self.engine.adapters)
        self.engine_ranks = cfg.world_size
        self.controls = (
            Controls(serve.get_replica_context().replica_id.unique_id, self.engine)
            if args.enable_control_routes
            else None
        )
        if self.controls is not None:  # before serving: a control reaching this deployment reaches this replica
            await self.controls.join()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve's controller for the request router: this replica's prefix-cache digest and load."""
        return await replica_routing_stats(self.engine)

    async def check_health(self) -> None:
        """Serve's periodic check: raising restarts this replica (and so its engine)."""
        await asyncio.to_thread(self.engine.check_health)

    # ---- validation helpers ----

    def _authorize(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        given = (authorization or "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        self._authorize(request.headers.get("authorization"))
        return await read_json(request, self.max_body_bytes)

    def _bad_words(self, words: list[str] | None) -> list[list[int]] | None:
        """Each word as it would be tokenized at the start of a text and after a space (vLLM's variants)."""
        if not words:
            return None
        variants = {tuple(self.tokenizer.encode(v, add_special_tokens=False)) for w in words for v in (w, " " + w)}
        return [list(v) for v in variants if v]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids(self.tokenizer, prompt)

    def _max_tokens(self, num_prompt: int, requested: int | None, param: str, prompt_param: str) -> int:
        """The request's max_tokens (by default all the room left), or 400 if the sequence cannot fit."""
        room = self.max_seq_len - num_prompt
        limit = (
            f"this server's limit is {self.max_seq_len} tokens per sequence (prompt + output; "
            f"max_model_len={self.engine.max_model_len})"
        )
        if room < 1:
            raise bad_request(f"the prompt has {num_prompt} tokens: {limit}", prompt_param, "context_length_exceeded")
        if requested is not None and requested > room:
            raise bad_request(
                f"{param}={requested} with a {num_prompt}-token prompt is too long: {limit}",
                param,
                "context_length_exceeded",
            )
        return requested or room

    async def _generation(
        self,
        req: SamplingFields,
        prompt_ids: list[int],
        max_tokens: int,
        num_logprobs: int | None,
        tools: ToolCalling | None = None,
        lora_name: str | None = None,
    ) -> Generation:
        # Under fcfs the scheduler ignores priority: refuse it rather than silently not honour it, as vLLM does.
        if req.priority != 0 and self.scheduling_policy != "priority":
            raise bad_request(
                f"priority={req.priority} needs the priority scheduling policy; this server schedules "
                f"{self.scheduling_policy} (serve with scheduling_policy=priority)",
                "priority",
            )
        params = req.sampling_params(
            max_tokens,
            num_logprobs,
            tools.constraint(self.close_objects) if tools else None,
            self._bad_words(req.bad_words),
            self.sampling_defaults,
            self.close_objects,
        )
        try:
            return await Generation(
                self.admission,
                self.tokenizer,
                self.metrics,
                prompt_ids,
                params,
                req,
                self.request_timeout_s,
                lora_name,
            ).start()
        except RequestError as e:  # the engine's check
            raise await self.served.unloaded(e) or req.refusal(e) from None

    async def _run(
        self,
        req: SamplingFields,
        prompt_ids: list[int],
        max_tokens: int,
        num_logprobs: int | None,
        fmt_type: Callable[..., Format],
        prefix: str,
        lora_name: str | None = None,
        **fmt_fields: Any,
    ) -> Response:
        gen = await self._generation(req, prompt_ids, max_tokens, num_logprobs, fmt_fields.get("tools"), lora_name)
        fmt = fmt_type(self.tokenizer, new_id(prefix), lora_name or self.model_name, num_logprobs, **fmt_fields)
        if req.stream:
            return StreamingResponse(stream_sse(gen, fmt, req.include_usage), media_type="text/event-stream")
        return json_response(await collect(gen, fmt))

    # ---- OpenAI endpoints ----

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await self._body(request))
        lora_name = await self.served.check(req.model)
        prompt = req.single_prompt()
        ids = self._prompt_ids(prompt)
        max_tokens = self._max_tokens(len(ids), req.max_tokens, "max_tokens", "prompt")
        echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) if req.echo else ""
        return await self._run(
            req,
            ids,
            max_tokens,
            req.logprobs,
            CompletionFormat,
            "cmpl",
            lora_name,
            echo=echo,
            prompt_token_ids=ids,
            num_prompt_logprobs=req.prompt_logprobs,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await self._body(request))
        lora_name = await self.served.check(req.model)
        num_logprobs = req.num_logprobs
        ids, tools = chat_request_ids(self.tokenizer, req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(len(ids), req.requested_max_tokens, param, "messages")
        return await self._run(req, ids, max_tokens, num_logprobs, ChatFormat, "chatcmpl", lora_name, tools=tools)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        req = parse(ResponsesRequest, await self._body(request))
        lora_name = await self.served.check(req.model)
        history = self.response_store.get(req.previous_response_id) if req.previous_response_id else []
        try:
            chat = req.chat_request(history)
            ids, tools = chat_request_ids(self.tokenizer, chat)
            max_tokens = self._max_tokens(len(ids), chat.requested_max_tokens, "max_output_tokens", "input")
            gen = await self._generation(chat, ids, max_tokens, None, tools, lora_name)
        except APIError as e:
            raise responses_error(e) from None
        run = ResponsesRun(
            req,
            lora_name or self.model_name,
            tools,
            chat.messages[bool(req.instructions is not None) :],
            self.response_store.put,
        )
        if req.stream:
            return StreamingResponse(run.events(gen), media_type="text/event-stream")
        return json_response(await run.collect(gen))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(self, request: Request) -> Response:
        """A response this replica stored (store=true), as it was returned."""
        self._authorize(request.headers.get("authorization"))
        return json_response(self.response_store.response(request.path_params["response_id"]))

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        """Each input's final hidden states pooled (``pooling_type``) and normalised, computed as one request each
        (the scheduler batches them with everything else in flight)."""
        req = parse(EmbeddingRequest, await self._body(request))
        lora_name = await self.served.check(req.model)
        if not self.serves_embeddings:
            raise bad_request(not_an_embedding_model(self.model_name), "model")
        prompts = embedding_prompts(self.tokenizer, req.inputs(), self.max_seq_len, self.engine.max_model_len)
        params = SamplingParams(max_tokens=1, pooling=self.pooling_type, dimensions=req.dimensions)
        results = await asyncio.gather(
            *(embed(self.admission, self.metrics, self.served, ids, params, lora_name) for ids in prompts),
            return_exceptions=True,
        )
        if error := next((r for r in results if isinstance(r, BaseException)), None):
            raise error
        data = [Embedding(index=i, embedding=encoded(v, req.encoding_format)) for i, v in enumerate(results)]
        num_tokens = sum(map(len, prompts))
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return json_response(EmbeddingResponse(data=data, model=lora_name or self.model_name, usage=usage))

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request.headers.get("authorization"))
        return json_response(ModelList(data=await self.served.cards()))

    @app.get("/v1/models/{model_id:path}")
    async def model(self, request: Request) -> Response:
        """One model's card (the SDK's models.retrieve); a model id may hold slashes (org/name)."""
        self._authorize(request.headers.get("authorization"))
        return json_response(self.served.card(await self.served.check(request.path_params["model_id"])))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Load a LoRA adapter at run time (vLLM's body) into every replica's engine; 400 naming it when the name
        is taken or it does not fit the model. Requests in flight run on meanwhile."""
        req = parse(LoadLoraAdapterRequest, await self._body(request))
        await self.served.load(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """Unload a LoRA adapter (vLLM's body) from every replica's engine; 400 naming it when it is absent or
        requests on some replica still run with it."""
        req = parse(UnloadLoraAdapterRequest, await self._body(request))
        await self.served.unload(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        is_chat = isinstance(body, dict) and "messages" in body
        req = parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)
        await self.served.check(req.model)
        ids = (
            chat_ids(self.tokenizer, req.messages, req.add_generation_prompt)
            if is_chat
            else self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        )
        return json_response(TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids))

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        req = parse(DetokenizeRequest, await self._body(request))
        await self.served.check(req.model)
        vocab = len(self.tokenizer)
        if bad := next((t for t in req.tokens if t >= vocab), None):
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return json_response(DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)))

    # ---- operations ----

    @app.get("/health")
    async def health(self) -> Response:
        """200 while this replica serves its model; 503 while it drains, or if its engine is down, or (pd) while no
        prefill replica serves. Serve starts the replica's HTTP server only once the model is loaded, so nothing
        answers 200 before it serves."""
        if self.drain.is_stopping():
            return json_response(APIError(503, "this replica is shutting down", code=DRAIN_CODE).body(), 503)
        try:
            await asyncio.to_thread(self.engine.check_health)
            if self.pd is not None:
                await self.pd.check_prefill()
        except Exception as e:  # the engine's check_health's reason says what is wrong; the code says it is unhealthy
            return json_response(APIError(503, str(e), code="engine_unhealthy").body(), 503)
        return Response(status_code=200)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> Response:
        self._authorize(request.headers.get("authorization"))
        return Response(json.dumps(openapi_schema(app, self.model_name)), media_type="application/json")

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> HTMLResponse:
        self._authorize(request.headers.get("authorization"))
        return get_swagger_ui_html(openapi_url="/openapi.json", title="raylm")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> HTMLResponse:
        self._authorize(request.headers.get("authorization"))
        return get_redoc_html(openapi_url="/openapi.json", title="raylm")

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._authorize(request.headers.get("authorization"))
        text = await asyncio.to_thread(render_node_metrics, self.metrics_port)
        return Response(text, media_type=CONTENT_TYPE)

    # ---- RL rollout controls (serve/controls.py: each reaches every replica; enable_control_routes) ----

    def _controls(self, request: Request) -> Controls:
        """The controls, behind the API key; without enable_control_routes the routes do not exist (404)."""
        if self.controls is None:
            raise APIError(404, "Not Found", code="not_found")
        self._authorize(request.headers.get("authorization"))
        return self.controls

    @app.post("/sleep", include_in_schema=False)
    async def control_sleep(self, request: Request) -> Response:
        """``?level=1`` frees every replica's KV cache, ``2`` its weights too; requests sent meanwhile wait for
        /wake_up. A 400 while requests are live (/pause?mode=abort ends them)."""
        level = sleep_level(request.query_params)
        answers = await self._controls(request).each("sleep", (level,))
        return json_reply({"level": level, "replicas": per_replica(answers)})

    @app.post("/wake_up", include_in_schema=False)
    async def control_wake_up(self, request: Request) -> Response:
        """``?tags=weights`` / ``kv_cache`` (repeated or comma-separated; none: both) brought back on every replica."""
        tags = wake_tags(request.query_params)
        answers = await self._controls(request).each("wake_up", (tags,), "tags")
        return json_reply({"tags": tags, "replicas": per_replica(answers)})

    @app.get("/is_sleeping", include_in_schema=False)
    async def control_is_sleeping(self, request: Request) -> Response:
        """True while anything sleeps on any replica."""
        answers = await self._controls(request).each("is_sleeping")
        return json_reply(
            {"is_sleeping": any(a.value for a in answers), "replicas": per_replica(answers, "is_sleeping")}
        )

    @app.post("/pause", include_in_schema=False)
    async def control_pause(self, request: Request) -> Response:
        """Every replica schedules nothing until /resume; ``?mode=abort`` (default) ends every live request
        (``aborted``: how many), ``wait`` returns once they finished, ``keep`` freezes them."""
        mode = pause_mode(request.query_params)
        answers = await self._controls(request).each("pause_generation", (mode,), "mode")
        return json_reply(
            {"mode": mode, "aborted": sum(a.value for a in answers), "replicas": per_replica(answers, "aborted")}
        )

    @app.post("/resume", include_in_schema=False)
    async def control_resume(self, request: Request) -> Response:
        answers = await self._controls(request).each("resume_generation")
        return json_reply({"replicas": per_replica(answers)})

    @app.get("/is_paused", include_in_schema=False)
    async def control_is_paused(self, request: Request) -> Response:
        """True while any replica is paused."""
        answers = await self._controls(request).each("is_paused")
        return json_reply({"is_paused": any(a.value for a in answers), "replicas": per_replica(answers, "is_paused")})

    @app.post("/reset_prefix_cache", include_in_schema=False)
    async def control_reset_prefix_cache(self, request: Request) -> Response:
        answers = await self._controls(request).each("reset_prefix_cache")
        return json_reply({"success": all(a.value for a in answers), "replicas": per_replica(answers, "success")})

    @app.post("/update_weights_from_disk", include_in_schema=False)
    async def control_update_weights_from_disk(self, request: Request) -> Response:
        """Every replica's weights read from the checkpoint at ``model_path`` (all or none on each)."""
        controls = self._controls(request)
        req = parse(UpdateWeightsFromDiskRequest, await self._body(request))
        args = (req.model_path, req.flush_cache, req.weight_version)
        answers = await controls.each("update_weights_from_disk", args, "model_path")
        return json_reply({"success": True, "weight_version": req.weight_version, "replicas": per_replica(answers)})

    @app.post("/init_weights_update_group", include_in_schema=False)
    async def control_init_weights_update_group(self, request: Request) -> Response:
        """Every replica's ranks join the trainer's group; replica i of n (in replica-id order) takes ranks
        ``rank_offset + i * R`` on (R: one engine's ranks, tensor x pipeline parallel), so ``world_size`` must
        hold at least ``rank_offset + n * R`` ranks. The answer gives each replica's first rank."""
        controls = self._controls(request)
        req = parse(InitWeightsUpdateGroupRequest, await self._body(request))
        ranks = self.engine_ranks

        def args(i: int, n: int) -> tuple:
            if i == 0 and req.world_size < (needed := req.rank_offset + n * ranks):
                raise bad_request(
                    f"world_size={req.world_size} cannot hold this deployment's ranks: rank_offset="
                    f"{req.rank_offset} plus {n} replica(s) x {ranks} rank(s) each needs world_size >= {needed}",
                    "world_size",
                )
            offset = req.rank_offset + i * ranks
            return (req.master_address, req.master_port, offset, req.world_size, req.group_name, req.backend)

        answers = await controls.each("init_weights_update_group", args)
        replicas = [{"replica": a.replica, "rank_offset": a.args[2]} for a in answers]
        return json_reply({"success": True, "replicas": replicas})

    @app.post("/update_weights_from_distributed", include_in_schema=False)
    async def control_update_weights_from_distributed(self, request: Request) -> Response:
        """One bucket the trainer broadcasts to the group: every replica's ranks receive it together."""
        controls = self._controls(request)
        req = parse(UpdateWeightsFromDistributedRequest, await self._body(request))
        args = (req.names, req.dtypes, req.shapes, req.group_name, req.flush_cache, req.weight_version)
        answers = await controls.each("update_weights_from_distributed", args, "names")
        return json_reply({"success": True, "weight_version": req.weight_version, "replicas": per_replica(answers)})

    @app.get("/get_weight_version", include_in_schema=False)
    async def control_get_weight_version(self, request: Request) -> Response:
        """The replicas' weight version ("default" until an update names one); null when they differ."""
        answers = await self._controls(request).each("get_weight_version")
        return json_reply({"weight_version": common(answers), "replicas": per_replica(answers, "weight_version")})

    # ---- forwarded by the model router (model_router.py) ----

    async def forwarded(
        self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[dict[str, Any]]:
        """One HTTP request that several models' endpoint routed here, run through this replica's own routes:
        yields the ASGI response messages (the start, then each body chunk). Closing the stream (the client went
        away) cancels the request, which aborts it in the engine."""
        async with aclosing(asgi_messages(self.app, method, path, query, headers, body)) as messages:
            async for message in messages:
                yield message

    # ---- gRPC (method names are the .proto's) ----

    async def _grpc_generation(self, request: GenerateRequest, context: RayServegRPCContext) -> Generation:
        self._authorize(dict(context.invocation_metadata()).get("authorization"))
        req = parse(CompletionRequest, completion_body(request))
        lora_name = await self.served.check(req.model or None)
        ids = self._prompt_ids(req.single_prompt())
        max_tokens = self._max_tokens(len(ids), req.max_tokens, "max_tokens", "prompt")
        return await self._generation(req, ids, max_tokens, None, lora_name=lora_name)

    async def Generate(self, request: GenerateRequest, grpc_context: RayServegRPCContext) -> GenerateResponse:
        try:
            return await grpc_replies.reply(await self._grpc_generation(request, grpc_context))
        except APIError as e:
            grpc_replies.abort(grpc_context, e)
            return GenerateResponse()

    async def GenerateStream(
        self, request: GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[GenerateResponse]:
        try:
            gen = await self._grpc_generation(request, grpc_context)
            async with aclosing(grpc_replies.replies(gen)) as stream:
                async for message in stream:
                    yield message
        except APIError as e:
            grpc_replies.abort(grpc_context, e)
            raise  # a streaming call ends with the status set only when it raises
