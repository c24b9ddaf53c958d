"""The OpenAI fields beyond plain sampling, against one live server with the official client: structured
outputs (response_format, vLLM's structured_outputs), logit_bias, allowed_token_ids, echo,
include_stop_str_in_output, cache_salt, tool calls, and the refused-field table."""

import json
import re
import socket

import httpx2 as httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from ray import serve

from cluster.config import EngineConfig
from cluster.serve import AppArgs, start

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = "SmolLM2-135M-Instruct"

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_of_enums": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120}, "height": {"type": "number"},
        "alive": {"type": "boolean"}}, "required": ["age", "alive"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
        "required": ["id", "tag"], "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "Describe a person in JSON."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(default_model_dir):
    args = AppArgs(engine=EngineConfig(model=default_model_dir, max_model_len=1024, max_num_seqs=8,
                                       kv_cache_bytes=64 << 20), served_model_name=MODEL)
    yield start(args, host="127.0.0.1", port=free_port(), grpc_port=free_port())
    serve.shutdown()


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def json_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


# ---- structured outputs ------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_output_validates(client, name):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                         response_format=json_format(name))
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


@pytest.mark.parametrize("name", ["nested", "array_of_objects"])
def test_streamed_json_schema_output_validates_and_equals_the_whole(client, name):
    kw = dict(model=MODEL, messages=ASK, max_tokens=120, temperature=0, response_format=json_format(name))
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert text == client.chat.completions.create(**kw).choices[0].message.content


class Person(BaseModel):
    name: str
    age: int


def test_the_clients_own_parse_helper(client):
    out = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                        response_format=Person)
    assert isinstance(out.choices[0].message.parsed, Person)


def test_json_object_and_completions_endpoint(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert out.choices[0].finish_reason == "length" and text.startswith("{")
    done = client.completions.create(model=MODEL, prompt="The colors:", max_tokens=60, temperature=0,
                                     extra_body={"structured_outputs": {"json": SCHEMAS["array_of_enums"]}})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMAS["array_of_enums"])


def test_n_2_with_a_schema_gives_two_valid_samples(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=7, n=2,
                                         response_format=json_format("numbers"))
    assert len(out.choices) == 2
    for c in out.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["numbers"])


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice(client, stream):
    def text(**extra):
        kw = dict(model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0, extra_body=extra)
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)

    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text(structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"}))
    assert text(structured_outputs={"choice": ["home", "work", "mobile"]}) in ("home", "work", "mobile")
    assert re.fullmatch(r"(ab)+c?", text(structured_outputs={"grammar": 'start: ("ab")+ "c"'}))


def test_a_constraint_that_needs_more_tokens_ends_with_length(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                         response_format=json_format("nested"))
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 4


# ---- sampling fields ----------------------------------------------------------------------


def test_logit_bias_and_allowed_token_ids(client, url):
    x = httpx.post(f"{url}/tokenize", json={"prompt": " x", "add_special_tokens": False}).json()["tokens"][0]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(x): 100})
    assert out.choices[0].text == " x" * 4
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                    extra_body={"allowed_token_ids": [x]})
    assert out.choices[0].text == " x" * 4


def test_echo_and_include_stop_str_in_output(client):
    plain = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "1, 2, 3," + plain
    kw = dict(model=MODEL, prompt="1, 2, 3,", max_tokens=16, temperature=0, stop=[" 5"])
    assert client.completions.create(**kw).choices[0].text == " 4,"
    assert client.completions.create(**kw, extra_body={"include_stop_str_in_output": True}).choices[0].text == " 4, 5"


def test_cache_salt_separates_prefix_caches(client):
    prompt = "A long shared preamble that fills several KV blocks. " * 8

    def cached(salt: str) -> int:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


# ---- refused fields ----------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": ASK}
REFUSED = [
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 2}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "bad_words": ["x"]}, "bad_words"),
    ({"prompt": "x", "structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"prompt": "x", "structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar"),
    (CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    (CHAT | {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED)
def test_refused_fields_are_400_naming_them(url, body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openapi_states_the_policy(url):
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        model = spec["components"]["schemas"][name]
        assert model["additionalProperties"] is False  # unknown fields: refused
        assert {"response_format", "structured_outputs", "logit_bias", "cache_salt"} <= set(model["properties"])
        assert "n" in model["properties"]["best_of"]["description"]
