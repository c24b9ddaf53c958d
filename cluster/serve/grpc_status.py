"""gRPC: API errors as gRPC status codes (the servicer methods are LLMServer's, named as in raylm.proto)."""

from __future__ import annotations

import grpc
from ray.serve.grpc_util import RayServegRPCContext

from cluster.serve.generation import Piece
from cluster.serve.protocol.parsing import APIError

GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def check(p: Piece) -> None:
    if p.finish_reason == "error":
        raise p.error


def abort(context: RayServegRPCContext, e: APIError) -> None:
    context.set_code(GRPC_CODES.get(e.status, grpc.StatusCode.INTERNAL))
    context.set_details(f"{e.param}: {e.message}" if e.param and not e.message.startswith(e.param) else e.message)
