"""The HTTP API fuzzed from its own /openapi.json (schemathesis): requests that fit the documented bodies and
requests that do not, to every operation. No response may be a 5xx, and every 4xx must carry an OpenAI-style
error body. The model is a tiny random Llama (with the default model's tokenizer and chat template) and a
64-token context, so a valid request finishes in milliseconds; EXAMPLES bounds the run (~40 s here).
``fuzz(url, examples, headers)`` runs it against any server (docs/operations.md)."""

from collections import Counter

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from engine.config import EngineConfig
from engine.network import free_port
from serve import AppArgs
from tests.serve.test_server import serving

pytestmark = pytest.mark.usefixtures("ray_session")

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 50  # per operation and mode (fitting the schema, not fitting it): ~700 requests


@pytest.fixture(scope="module")
def url(servable_tiny_model):
    path = servable_tiny_model()
    args = AppArgs(
        engine=EngineConfig(model=path, max_model_len=64, kv_cache_bytes=16 << 20, num_threads=1),
        api_key=KEY,
        max_body_bytes=1 << 16,
    )
    with serving(args, host="127.0.0.1", port=free_port(), grpc_port=free_port()) as url:
        yield url


def check_response(case, response) -> None:
    status = response.status_code
    assert status < 500, f"{case.method} {case.path} {case.body!r}: {status} {response.text[:500]}"
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
        assert "code" in error and "param" in error, error


def fuzz(url: str, examples: int, headers: dict[str, str]) -> Counter:
    """Run ``examples`` generated requests per operation and mode against ``url``; returns how many of each
    (mode, status) it saw.
    The first response that breaks the rules fails at once (no shrinking: a short report, a bounded run)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers, timeout=30)
    statuses: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            if mode is GenerationMode.NEGATIVE and not operation.body:
                continue  # nothing to break: no body (and no parameters) to make invalid

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=url, headers=headers, timeout=60)
                statuses[mode.value, response.status_code] += 1  # noqa: B023 (called within this iteration)
                check_response(case, response)

            run()
    return statuses


def test_the_openapi_document_describes_the_request_bodies(url):
    doc = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "temperature", "stream"} <= set(completion["properties"])
    assert completion["additionalProperties"] is False  # the server refuses fields it does not honour


def test_fuzzed_requests_get_no_server_error_and_openai_errors(url):
    statuses = fuzz(url, EXAMPLES, AUTH)
    print(f"\nfuzzed {sum(statuses.values())} requests: statuses {dict(sorted(statuses.items()))}")
    assert statuses["positive", 200] and statuses["negative", 400]  # both kinds reached the server
