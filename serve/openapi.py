"""The OpenAPI document: FastAPI's, plus the request and error bodies the routes really take and give.

The routes read their JSON themselves (a size limit first, then one 400 naming the parameter), so FastAPI
sees no body model; this puts the protocol models' JSON Schemas in, so that the document describes the real
API (a client generator or a fuzzer built from it sends what the server validates).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from serve.protocol.chat import ChatCompletionRequest
from serve.protocol.completions import CompletionRequest
from serve.protocol.embeddings import EmbeddingRequest
from serve.protocol.parsing import ErrorResponse
from serve.protocol.responses import ResponsesRequest
from serve.protocol.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

REF = "#/components/schemas/{model}"
BODIES: dict[str, list[type[BaseModel]]] = {
    "/v1/completions": [CompletionRequest],
    "/v1/chat/completions": [ChatCompletionRequest],
    "/v1/responses": [ResponsesRequest],
    "/v1/embeddings": [EmbeddingRequest],
    "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
    "/detokenize": [DetokenizeRequest],
}
ERRORS = {
    "400": "Bad input, naming the parameter",
    "401": "A missing or wrong API key",
    "404": "An unknown model or route",
    "413": "A body over max_body_bytes",
    "429": "The replica's queue is full (Retry-After says when to retry)",
    "503": "The engine failed or the replica is shutting down (Retry-After)",
    "504": "Past request_timeout_s",
}


def _ref(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template=REF)
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def openapi_schema(app: FastAPI, model_name: str) -> dict[str, Any]:
    """The document for a server serving ``model_name``, the one value its ``model`` fields take."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    error = {"content": {"application/json": {"schema": _ref(ErrorResponse, schemas)}}}
    for path, models in BODIES.items():
        refs = [_ref(m, schemas) for m in models]
        body = refs[0] if len(refs) == 1 else {"anyOf": refs}
        operation = doc["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        operation["responses"].update({code: {"description": why, **error} for code, why in ERRORS.items()})
    for schema in schemas.values():
        if "model" in schema.get("properties", {}):
            schema["properties"]["model"]["anyOf"] = [{"enum": [model_name]}, {"type": "null"}]
    return doc
