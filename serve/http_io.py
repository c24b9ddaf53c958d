"""HTTP plumbing: reading a JSON body within a size limit, JSON responses, and a request run through an ASGI app."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from serve.protocol.parsing import APIError, bad_request

# JSON can only carry a surrogate as a \uD800-\uDFFF escape (UTF-8 bytes of one do not decode): a body
# without one needs no walk.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes, refused (413) once they pass ``limit``, before anything parses them."""
    too_large = APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def read_json(request: Request, limit: int) -> Any:
    """The decoded body, refused (413) once it passes ``limit`` bytes, before anything parses it."""
    body = await read_body(request, limit)
    try:
        value = json.loads(body)
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise bad_request("the body is nested too deeply to decode as JSON", code="invalid_json") from None
    if SURROGATE_ESCAPE.search(body) and (where := lone_surrogate(value)) is not None:
        raise bad_request(
            f"{where or 'body'}: the text holds a lone UTF-16 surrogate (an unpaired \\uD800-"
            f"\\uDFFF escape), which is not Unicode text",
            where or None,
        )
    return value


def lone_surrogate(value: Any) -> str | None:
    """The path ("messages[0].content") of a string holding a lone surrogate ("" for the body or a key
    of it), else None. A valid pair decodes to one character; only a lone one fails to encode, and the
    tokenizer raises on it. A loop, not recursion: the body may be nested as deep as the decoder allows."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                return path
        elif isinstance(v, dict):
            for key, item in v.items():
                if lone_surrogate(key) is not None:
                    return path  # the key cannot be named: echoing it would put the surrogate in the reply
                stack.append((f"{path}.{key}".lstrip("."), item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


async def asgi_messages(
    app: Any, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> AsyncIterator[dict[str, Any]]:
    """One HTTP request run through an ASGI app: yields its response messages (the start, then each body chunk).
    Closing the generator (the client went away) cancels the app's task, which aborts the request."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query,
        "headers": headers,
        "client": None,
        "server": None,
    }
    messages: asyncio.Queue = asyncio.Queue()
    body_sent = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if not body_sent.is_set():
            body_sent.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect comes this way: closing the stream cancels the task
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body"):
                break
    finally:
        task.cancel()
