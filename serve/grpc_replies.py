"""gRPC: a request as the completions body it stands for, a generation as GenerateResponse messages, and API errors
as status codes (the servicer methods are LLMServer's, named as in raylm.proto)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from ray.serve.grpc_util import RayServegRPCContext

from serve.generation import Generation, Piece
from serve.protocol.parsing import APIError
from serve.raylm_pb2 import GenerateRequest, GenerateResponse

GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def completion_body(request: GenerateRequest) -> dict[str, Any]:
    """The /v1/completions body the request stands for: only the fields that are set, the prompt as text or ids."""
    body = MessageToDict(request, preserving_proto_field_name=True)
    body["prompt"] = body.pop("prompt_token_ids", None) or request.prompt
    return body


async def reply(gen: Generation) -> GenerateResponse:
    """The whole generation as one message; an error piece raises its APIError."""
    message = GenerateResponse()
    async with aclosing(gen.pieces()) as stream:
        async for pieces in stream:
            for p in pieces:
                _check(p)
                message.text += p.text
                message.token_ids.extend(p.token_ids)
                message.finish_reason = p.finish_reason or ""
    message.num_prompt_tokens, message.num_generated_tokens = len(gen.prompt_ids), len(message.token_ids)
    return message


async def replies(gen: Generation) -> AsyncIterator[GenerateResponse]:
    """A message per piece as it is generated; an error piece raises its APIError."""
    sample = gen.samples[0]
    async with aclosing(gen.pieces()) as stream:
        async for pieces in stream:
            for p in pieces:
                _check(p)
                yield GenerateResponse(
                    text=p.text,
                    token_ids=p.token_ids,
                    finish_reason=p.finish_reason or "",
                    num_prompt_tokens=len(gen.prompt_ids),
                    num_generated_tokens=len(sample.token_ids),
                )


def _check(p: Piece) -> None:
    if p.finish_reason == "error":
        raise p.error


def abort(context: RayServegRPCContext, e: APIError) -> None:
    context.set_code(GRPC_CODES.get(e.status, grpc.StatusCode.INTERNAL))
    context.set_details(f"{e.param}: {e.message}" if e.param and not e.message.startswith(e.param) else e.message)
