"""HTTP plumbing: reading a JSON body within a size limit, and JSON responses."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from cluster.serve.protocol import APIError, bad_request


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


