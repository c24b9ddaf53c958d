"""The FastAPI app the replica's routes hang on (LLMServer), and how an error becomes an OpenAI-style body."""

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from serve.http_io import json_response
from serve.protocol.parsing import APIError

# FastAPI's own docs routes would answer without the API key: LLMServer serves them behind it instead.
app = FastAPI(
    title="raylm", description="OpenAI-compatible LLM serving on Ray", docs_url=None, redoc_url=None, openapi_url=None
)
# A refusal that a retry may get past (a full queue, an engine being replaced) says when to try again.
RETRY_AFTER = {429: "1", 503: "5"}


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> Response:
    response = json_response(e.body(), e.status)
    if e.status in RETRY_AFTER:
        response.headers["Retry-After"] = RETRY_AFTER[e.status]
    return response


@app.exception_handler(HTTPException)
async def _http_error(_: Request, e: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return json_response(APIError(e.status_code, str(e.detail), code=code).body(), e.status_code)


@app.exception_handler(Exception)
async def _internal_error(_: Request, e: Exception) -> Response:
    return json_response(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), 500)
