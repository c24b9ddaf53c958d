"""The Responses API without a server: requests as the openai SDK sends them turned into the chat request they run
as, refusals naming the Responses field, and the per-replica store behind previous_response_id. The live API
(create, stream, a two-turn conversation) is tested in test_openai_fields.py, on that module's server."""

import json
from types import SimpleNamespace

import httpx2 as httpx
import openai
import pytest

from serve.protocol.chat import ChatMessage
from serve.protocol.parsing import APIError, parse
from serve.protocol.responses import ResponsesRequest, responses_error
from serve.response_store import ResponseStore

TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def sent(call) -> dict:
    """The JSON body the openai SDK sends for ``call(client)``."""
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "captured", "type": "invalid_request_error"}})

    client = openai.OpenAI(
        base_url="http://sdk/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    with pytest.raises(openai.BadRequestError):
        call(client)
    return bodies[0]


def test_sdk_requests_become_the_chat_requests_they_run_as():
    body = sent(
        lambda c: c.responses.create(
            model="m",
            instructions="Be brief.",
            input=[
                {"role": "user", "content": "Weather in Oslo?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=7,
            temperature=0,
            text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        )
    )
    history = [ChatMessage(role="user", content="Earlier."), ChatMessage(role="assistant", content="Yes.")]
    chat = parse(ResponsesRequest, body).chat_request(history)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert chat.messages[0].content == "Be brief." and chat.messages[-1].tool_call_id == "c1"
    assert chat.messages[-2].tool_calls[0].function.name == "get_weather"
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    assert (chat.max_completion_tokens, chat.temperature) == (7, 0)
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"input": []}, "input"),
    ],
)
def test_what_it_does_not_serve_is_a_400_naming_the_field(body, param):
    """Each refusal names its field (logprobs is the one `include` value whose output raylm could add and does not)."""
    with pytest.raises(APIError) as e:
        req = parse(ResponsesRequest, body)
        try:
            req.chat_request([])
        except APIError as chat_error:
            raise responses_error(chat_error) from None
    assert (e.value.status, e.value.param) == (400, param) and e.value.message.startswith(param)


def test_reasoning_is_accepted_and_changes_nothing():
    plain = parse(ResponsesRequest, {"input": "hi"}).chat_request([])
    with_reasoning = parse(ResponsesRequest, {"input": "hi", "reasoning": {"effort": "high"}}).chat_request([])
    assert with_reasoning == plain


def test_the_store_is_bounded_expires_and_names_an_unknown_id(monkeypatch):
    store = ResponseStore(capacity=2, ttl_s=10)
    clock = [100.0]
    monkeypatch.setattr("serve.response_store.time.monotonic", lambda: clock[0])
    for i in range(3):
        store.put(SimpleNamespace(id=f"resp_{i}"), [ChatMessage(role="user", content=str(i))])
    assert store.get("resp_2")[0].content == "2" and store.get("resp_1")
    assert store.response("resp_2").id == "resp_2"
    with pytest.raises(APIError) as e:
        store.get("resp_0")  # the oldest, past the capacity
    assert (e.value.status, e.value.param) == (404, "previous_response_id") and "resp_0" in e.value.message
    with pytest.raises(APIError) as e:
        store.response("resp_0")
    assert (e.value.status, e.value.code) == (404, "response_not_found") and "resp_0" in e.value.message
    clock[0] += 11
    with pytest.raises(APIError):
        store.get("resp_2")  # expired


def test_include_naming_output_this_server_never_produces_is_accepted():
    """The Agents SDK sends `include` on every request: reasoning and built-in tools' output that this server
    never produces is honoured by adding nothing."""
    req = parse(
        ResponsesRequest, {"input": "hi", "include": ["reasoning.encrypted_content", "file_search_call.results"]}
    )
    assert req.chat_request([]).messages[-1].content == "hi"
