"""Several base models behind one endpoint: the app's ingress when ``raylm serve --model A --model B`` (or a
``models`` list) asks for more than one. Each model is its own LLMServer deployment (its own engine, replicas
and autoscaling bounds); this deployment reads each request's ``model`` and forwards the request to that
deployment's handle, whose replica runs it through its own routes (``LLMServer.forwarded``) and streams the
response back.

Why a forwarding ingress. HTTP reaches an app through HAProxy straight to the replicas of the app's one ingress
deployment (ingress.py); the ingress request router (router.py) may only pick among those replicas (HAProxy
answers any other replica id with a 503), so it cannot send a request to another model's deployment. Forwarding
costs every streamed chunk one Ray streaming-generator hop and this replica's event loop, as Serve's Python
proxy did; a one-model app has no such ingress and keeps the direct path.

Routing: a POST goes to the deployment serving its body's ``model`` (a body without one, or not JSON, to the
first model, which answers as it would alone); ``GET /v1/models`` lists every model; ``GET /v1/models/{id}``
and ``GET /v1/responses/{id}`` ask the deployment(s) that may know the id; ``/health`` is healthy when every
model is; ``/metrics`` is the node's export, where every model's series carry its ``model_name``. An unknown
``model`` is a 404 naming the known ones. gRPC is not routed (the gRPC service is served by one-model apps).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) through Serve's
# wrappers, whose globals are not this module's (as in server.py).

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve import http_app
from serve import server as llm_server
from serve.http_io import json_response, read_body
from serve.protocol.parsing import APIError

router_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


@router_app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> Response:
    return json_response(e.body(), e.status)


class RoutedServer(llm_server.LLMServer.func_or_class.__bases__[0]):
    """LLMServer, less its @serve.ingress (Serve allows one ingress deployment per app: the ModelRouter): the
    same replica, whose routes run on the requests the router forwards (``forwarded``). Its routes find their
    replica through Serve's replica context, as the ingress's do."""

    @property
    def app(self) -> FastAPI:
        return http_app.app

    async def served_names(self) -> list[str]:
        """The base model's name and its LoRA adapters' (those loaded at run time included)."""
        return [self.model_name, *await self.served.names()]


RoutedLLMServer = serve.deployment(name="LLMServer")(RoutedServer)


@serve.deployment(name="ModelRouter")
@serve.ingress(router_app)
class ModelRouter:
    """The endpoint of several models: ``servers`` maps each served model name to its deployment, the first being
    where requests that name no model go. Holds no state of its own: every answer is a deployment's, but a body
    over every model's ``max_body_bytes`` (413), or an unknown model (404)."""

    def __init__(self, servers: dict[str, DeploymentHandle], max_body_bytes: int) -> None:
        self.servers = servers
        self.max_body_bytes = max_body_bytes  # the largest the models take: each checks its own

    async def _server(self, model: str | None, param: str = "model") -> DeploymentHandle:
        """The deployment serving ``model``: a base model's own, or the one whose replica holds the LoRA adapter
        of that name (asked when a name is not a base model's: adapters load and unload at run time)."""
        if model is None:
            return next(iter(self.servers.values()))
        if model in self.servers:
            return self.servers[model]
        known = []
        for server in self.servers.values():
            names = await server.served_names.remote()
            if model in names:
                return server
            known += names
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {', '.join(map(repr, known))}",
            param,
            "model_not_found",
        )

    async def _forward(self, server: DeploymentHandle, request: Request, body: bytes) -> Response:
        scope = request.scope
        stream = server.options(stream=True).forwarded.remote(
            scope["method"], scope["path"], scope["query_string"], list(scope["headers"]), body
        )
        start = await anext(stream, None)
        if start is None:
            raise APIError(500, "the model's replica ended the request without a response")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"] if k not in HOP_HEADERS}

        async def chunks():
            try:
                async for message in stream:
                    yield message.get("body", b"")
            finally:
                stream.cancel()  # the client went away, or the body ended: nothing more runs there

        return StreamingResponse(chunks(), status_code=start["status"], headers=headers)

    async def _collect(self, server: DeploymentHandle, request: Request, body: bytes = b"") -> tuple[int, bytes]:
        response = await self._forward(server, request, body)
        return response.status_code, b"".join([c async for c in response.body_iterator])

    @router_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's body names no base model: the adapter loads into the first model that takes it (another base
        refuses it, naming the mismatch); when none does, the first model's refusal is the answer."""
        body = await read_body(request, self.max_body_bytes)
        first = None
        for server in self.servers.values():
            status, answer = await self._collect(server, request, body)
            if status == 200:
                return Response(answer, status, media_type="application/json")
            first = first or Response(answer, status, media_type="application/json")
        return first

    @router_app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """To the model holding the adapter (the first model, which refuses it, when none does)."""
        body = await read_body(request, self.max_body_bytes)
        try:
            name = json.loads(body).get("lora_name")
        except (ValueError, AttributeError):
            name = None
        try:
            server = await self._server(name if isinstance(name, str) else None, "lora_name")
        except APIError:
            server = await self._server(None)
        return await self._forward(server, request, body)

    @router_app.post("/{path:path}")
    async def post(self, request: Request) -> Response:
        body = await read_body(request, self.max_body_bytes)
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):  # not JSON, or not an object: the first model answers its 400
            model = None
        return await self._forward(await self._server(model if isinstance(model, str) else None), request, body)

    @router_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        cards = []
        for server in self.servers.values():
            status, body = await self._collect(server, request)
            if status != 200:
                return Response(body, status, media_type="application/json")
            cards += json.loads(body)["data"]
        return Response(json.dumps({"object": "list", "data": cards}), media_type="application/json")

    @router_app.get("/v1/models/{model_id:path}")
    async def model(self, request: Request) -> Response:
        return await self._forward(await self._server(request.path_params["model_id"]), request, b"")

    @router_app.get("/v1/responses/{response_id}")
    async def stored_response(self, request: Request) -> Response:
        """Response ids are not tied to a model: ask each deployment until one has it (else the last 404)."""
        for server in self.servers.values():
            status, body = await self._collect(server, request)
            if status != 404:
                break
        return Response(body, status, media_type="application/json")

    @router_app.get("/health")
    async def health(self, request: Request) -> Response:
        for server in self.servers.values():
            status, body = await self._collect(server, request)
            if status != 200:
                return Response(body, status, media_type="application/json")
        return Response(status_code=200)

    @router_app.get("/{path:path}")
    async def other(self, request: Request) -> Response:
        """/metrics (the node's export, every model's series labelled), /openapi.json, /docs: the first model's."""
        return await self._forward(await self._server(None), request, b"")
