"""The OpenAI fields beyond plain sampling, against one live server with the official client: structured
outputs (response_format, vLLM's structured_outputs), logit_bias, allowed_token_ids, echo (with logprobs),
prompt_logprobs, include_stop_str_in_output, cache_salt, tool calls, and the refused-field table."""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from engine.config import EngineConfig
from engine.network import free_port
from serve import AppArgs, raylm_pb2, raylm_pb2_grpc
from tests.serve.test_server import metrics, serving, wait_metrics
from tests.workers.adapters import make_adapter

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = "SmolLM2-135M-Instruct"

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "height": {"type": "number"},
            "alive": {"type": "boolean"},
        },
        "required": ["age", "alive"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "minItems": 1,
        "maxItems": 2,
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
            "required": ["id", "tag"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Describe a person in JSON."}]


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory) -> dict[str, str]:
    """Two random LoRA adapters of the default model (rank 8, q/v): 'sql' served from the start, 'chat' loaded by
    the test that loads one."""
    root = tmp_path_factory.mktemp("adapters")
    lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return {
        name: make_adapter(default_model_dir, root / name, seed, **lora) for seed, name in enumerate(("sql", "chat"))
    }


@pytest.fixture(scope="module")
def server(default_model_dir, adapters):
    args = AppArgs(
        engine=EngineConfig(
            model=default_model_dir,
            max_model_len=1024,
            max_num_seqs=8,
            kv_cache_bytes=64 << 20,
            enable_lora=True,
            max_loras=2,
            lora_modules=[f"sql={adapters['sql']}"],
            runner="pooling",  # a chat model: its embeddings are asked for (the embeddings tests below)
        ),
        served_model_name=MODEL,
    )
    grpc_port = free_port()
    with serving(args, host="127.0.0.1", port=free_port(), grpc_port=grpc_port) as url:
        yield url, grpc_port


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    # A loaded 2-core machine runs the default model at about a token a second.
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def json_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


# ---- structured outputs ------------------------------------------------------------------


def concurrently(*calls):
    """The calls' results, run at once: the engine batches them, so the test waits for the longest only."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_json_schema_outputs_validate_streamed_and_not(client):
    def whole(name):
        c = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=120, temperature=0, response_format=json_format(name)
        ).choices[0]
        return c.message.content, c.finish_reason

    def streamed(name):
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=120, temperature=0, response_format=json_format(name), stream=True
            )
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].choices[
            0
        ].finish_reason

    names = list(SCHEMAS) + ["nested", "array_of_objects"]
    outs = concurrently(
        *[lambda n=n: whole(n) for n in SCHEMAS], *[lambda n=n: streamed(n) for n in ("nested", "array_of_objects")]
    )
    for name, (text, finish) in zip(names, outs):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


class Role(str, Enum):
    admin = "admin"
    user = "user"


class Address(BaseModel):
    city: str


class User(BaseModel):
    name: str
    age: int
    role: Role
    address: Address
    nickname: str | None = None
    tags: list[str] = Field(max_length=2)  # maxItems: a 135M model repeats an unbounded list's items


USER_ASK = [
    {"role": "user", "content": "Extract the user: Alice is a 30-year-old admin living in Paris. Tags: vip, early."}
]


def test_pydantic_schemas_as_libraries_send_them_end_with_stop_and_validate(client):
    """instructor (JSON_SCHEMA mode) and LangChain (bind_tools, with_structured_output) send pydantic's schema as it
    is: nested models under $defs, an enum, an Optional, a list, and no additionalProperties anywhere."""
    schema = User.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "User", "schema": schema}}
    tool = {"type": "function", "function": {"name": "User", "description": "Record a user.", "parameters": schema}}
    kw = dict(model=MODEL, messages=USER_ASK, max_tokens=100, temperature=0)
    as_format, as_tool = concurrently(
        lambda: client.chat.completions.create(response_format=fmt, **kw).choices[0],
        lambda: client.chat.completions.create(
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "User"}},
            parallel_tool_calls=False,
            **kw,
        ).choices[0],
    )
    assert as_format.finish_reason == "stop", as_format.message.content
    User.model_validate_json(as_format.message.content)
    assert as_tool.finish_reason == "tool_calls", as_tool.message
    User.model_validate_json(as_tool.message.tool_calls[0].function.arguments)


class Person(BaseModel):
    name: str
    age: int


def test_the_clients_own_parse_helper(client):
    out = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format=Person)
    assert isinstance(out.choices[0].message.parsed, Person)


def test_json_object_and_completions_endpoint(client):
    out, done = concurrently(
        lambda: client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format={"type": "json_object"}
        ),
        lambda: client.completions.create(
            model=MODEL,
            prompt="The colors:",
            max_tokens=60,
            temperature=0,
            extra_body={"structured_outputs": {"json": SCHEMAS["array_of_enums"]}},
        ),
    )
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert out.choices[0].finish_reason == "length" and text.startswith("{")
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMAS["array_of_enums"])


def test_n_2_with_a_schema_gives_two_valid_samples(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=7, n=2, response_format=json_format("numbers")
    )
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

    phone, choice, grammar = concurrently(
        lambda: text(structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
        lambda: text(structured_outputs={"choice": ["home", "work", "mobile"]}),
        lambda: text(structured_outputs={"grammar": 'start: ("ab")+ "c"'}),
    )
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone)
    assert choice in ("home", "work", "mobile")
    assert re.fullmatch(r"(ab)+c?", grammar)


def test_a_constraint_that_needs_more_tokens_ends_with_length(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0, response_format=json_format("nested")
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 4


def test_grpc_takes_the_same_constraints(server):
    with grpc.insecure_channel(f"127.0.0.1:{server[1]}") as channel:
        stub = raylm_pb2_grpc.RayLMStub(channel)
        regex = raylm_pb2.StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}")
        reply = stub.Generate(
            raylm_pb2.GenerateRequest(prompt="Call me at", max_tokens=20, temperature=0, structured_outputs=regex)
        )
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", reply.text) and reply.finish_reason == "stop"
        schema = raylm_pb2.StructuredOutputs(json=json.dumps(SCHEMAS["array_of_enums"]))
        text = "".join(
            r.text
            for r in stub.GenerateStream(
                raylm_pb2.GenerateRequest(prompt="Colors:", max_tokens=60, temperature=0, structured_outputs=schema)
            )
        )
        jsonschema.validate(json.loads(text), SCHEMAS["array_of_enums"])
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(
                raylm_pb2.GenerateRequest(prompt="x", structured_outputs=raylm_pb2.StructuredOutputs(regex="("))
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()


# ---- sampling fields ----------------------------------------------------------------------


def test_logit_bias_and_allowed_token_ids(client, url):
    x = httpx.post(f"{url}/tokenize", json={"prompt": " x", "add_special_tokens": False}).json()["tokens"][0]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(x): 100})
    assert out.choices[0].text == " x" * 4
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, extra_body={"allowed_token_ids": [x]}
    )
    assert out.choices[0].text == " x" * 4


def test_bad_words_are_never_completed(client):
    kw = dict(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert client.completions.create(**kw).choices[0].text.startswith(" 4")
    assert "4" not in client.completions.create(**kw, extra_body={"bad_words": ["4"]}).choices[0].text


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


def test_a_requests_model_names_the_base_or_a_lora_adapter(client, url, adapters):
    cards = {c.id: c.model_dump() for c in client.models.list().data}
    assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == adapters["sql"]
    assert cards[MODEL]["parent"] is None
    kw = dict(prompt="The capital of France is", max_tokens=6, temperature=0)
    base, sql = (client.completions.create(model=m, **kw) for m in (MODEL, "sql"))
    assert sql.model == "sql" and base.model == MODEL
    assert sql.choices[0].text != base.choices[0].text  # the adapter changes the greedy tokens
    r = httpx.post(f"{url}/v1/completions", json={**kw, "model": "nope"}, timeout=60)
    assert r.status_code == 404 and "'nope'" in r.text and "'sql'" in r.text


def test_lora_adapters_load_and_unload_at_run_time(client, url, adapters):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/{path}", json=body, timeout=120)

    kw = dict(prompt="def add(a, b):", max_tokens=4, temperature=0)
    r = post("load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]})
    assert r.status_code == 200, r.text
    assert "chat" in {c.id for c in client.models.list().data}
    assert client.completions.create(model="chat", **kw).model == "chat"
    for path, body, words in [
        ("load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}, ["'chat'", "already loaded"]),
        ("load_lora_adapter", {"lora_name": "gone", "lora_path": "/no/such/dir"}, ["'gone'", "does not exist"]),
        ("unload_lora_adapter", {"lora_name": "absent"}, ["'absent'", "not loaded"]),
    ]:
        r = post(path, body)
        assert r.status_code == 400 and all(w in r.json()["error"]["message"] for w in words), r.text
    assert post("unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={**kw, "model": "chat"}, timeout=60)
    assert r.status_code == 404


def test_echo_with_logprobs_and_prompt_logprobs_cover_the_prompt(client):
    """echo + logprobs: the prompt's tokens lead logprobs (the first one's null), then the same sampled part as
    without echo; vLLM's prompt_logprobs: per prompt token, a dict holding it and the top-k, the first None."""
    kw = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, logprobs=2)
    plain, echoed, asked = concurrently(
        lambda: client.completions.create(**kw),
        lambda: client.completions.create(**kw, echo=True),
        lambda: client.completions.create(**kw, extra_body={"prompt_logprobs": 3}),
    )
    n = echoed.usage.prompt_tokens
    lp, want = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert len(lp.tokens) == n + len(want.tokens) and "".join(lp.tokens[:n]) == kw["prompt"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[n] == len(kw["prompt"])
    assert all(v <= 0 for v in lp.token_logprobs[1:n])
    assert lp.tokens[n:] == want.tokens and lp.token_logprobs[n:] == pytest.approx(want.token_logprobs, abs=1e-3)
    assert echoed.choices[0].text == kw["prompt"] + plain.choices[0].text
    prompt = asked.choices[0].prompt_logprobs
    assert len(prompt) == n and prompt[0] is None and asked.choices[0].text == plain.choices[0].text
    for entry, token, logprob in zip(prompt[1:], lp.tokens[1:n], lp.token_logprobs[1:n]):
        mine = [e for e in entry.values() if e["decoded_token"] == token]
        assert 3 <= len(entry) <= 4 and mine and mine[0]["logprob"] == pytest.approx(logprob, abs=1e-3)
        assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    assert plain.choices[0].prompt_logprobs is None


# ---- refused fields ----------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": ASK}
REFUSED = [
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "bad_words": [""]}, "bad_words[0]"),
    ({"prompt": "x", "structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"prompt": "x", "logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": [1000000]}, "allowed_token_ids"),
    ({"prompt": "x", "structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar"),
    (
        CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
        "response_format.json_schema.schema",
    ),
    (CHAT | {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED)
def test_refused_fields_are_400_naming_them(url, body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_models_retrieve_and_an_unknown_id(client, url):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    r = httpx.get(f"{url}/v1/models/org/unknown", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'org/unknown'" in r.json()["error"]["message"] and repr(MODEL) in r.json()["error"]["message"]


def test_a_reply_without_tool_calls_leaves_the_field_out(url):
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT | {"max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_openapi_states_the_policy(url):
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        model = spec["components"]["schemas"][name]
        assert model["additionalProperties"] is False  # unknown fields: refused
        assert {"response_format", "structured_outputs", "logit_bias", "cache_salt"} <= set(model["properties"])
        assert "n" in model["properties"]["best_of"]["description"]


# ---- tool calls ---------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names=tuple(PARAMS)):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_a_forced_tool_call_parses_into_tool_calls(client, choice):
    out = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice_out = out.choices[0]
    assert choice_out.finish_reason == "tool_calls"
    names = ("get_time",) if isinstance(choice, dict) else tuple(PARAMS)
    check_calls(choice_out.message.tool_calls, names)
    assert len(choice_out.message.tool_calls) == 1


def test_a_streamed_tool_call_sends_id_and_name_then_arguments(client):
    kw = dict(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    deltas = [
        (c.choices[0].delta.tool_calls, c.choices[0].finish_reason)
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    ]
    calls = [d for tc, _ in deltas for d in tc or []]
    assert calls[0].id and calls[0].function.name and not calls[0].function.arguments
    assert len(calls) > 2 and all(d.id is None and d.function.name is None for d in calls[1:])  # arguments, in parts
    assert deltas[-1][1] == "tool_calls"
    with client.chat.completions.stream(**kw) as stream:  # the client's own accumulation of the deltas
        final = stream.get_final_completion()
    check_calls(final.choices[0].message.tool_calls)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function
    streamed = final.choices[0].message.tool_calls[0].function
    assert (streamed.name, streamed.arguments) == (whole.name, whole.arguments)
    assert "".join(d.function.arguments for d in calls[1:]) == whole.arguments


def test_auto_tool_choice_and_a_history_with_calls_and_results(client):
    history = WEATHER_ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    c = out.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls)
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content
    none = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0
    ).choices[0]
    assert not none.message.tool_calls and none.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tools_are_400_before_anything_runs(url, body, param):
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT | body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- the Responses API --------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", **{k: WEATHER["function"][k] for k in ("name", "description", "parameters")}}


def test_responses_a_function_tool_then_its_output_through_previous_response_id(client):
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions="Answer with a tool call.",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
        reasoning={"effort": "low"},  # ignored, as vLLM does for a model that does not reason
    )
    assert first.status == "completed" and first.output[-1].type == "function_call"
    call = first.output[-1]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}],
        max_output_tokens=20,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output_text
    assert second.status in ("completed", "incomplete")


def test_responses_a_two_turn_conversation_carries_the_first_turn(client):
    first = client.responses.create(model=MODEL, input="My name is Zed.", max_output_tokens=10, temperature=0)
    # include as the Agents SDK sends it on every request: output this model never produces adds nothing
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=10,
        temperature=0,
        include=["reasoning.encrypted_content"],
    )
    # The second prompt holds the first's and its output (the template's system prompt once), then the question.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    # GET /v1/responses/{id}: the stored response as it was returned; an unknown id is a 404 naming it.
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.retrieve("resp_nope")


def test_responses_stream_in_openais_order_with_a_json_schema_and_a_tool(client):
    def streamed(**kw):
        with client.responses.stream(model=MODEL, max_output_tokens=60, temperature=0, **kw) as stream:
            return list(stream), stream.get_final_response()

    (events, final), (call_events, call_final), whole = concurrently(
        lambda: streamed(input="Describe a person.", text_format=Person),
        lambda: streamed(
            input="What is the weather in Paris?",
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
        ),
        lambda: client.responses.parse(
            model=MODEL, input="Describe a person.", text_format=Person, max_output_tokens=60, temperature=0
        ),
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert isinstance(final.output_parsed, Person) and final.output_text == whole.output_text
    call_kinds = [e.type for e in call_events]
    assert call_kinds[-4:] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = call_final.output[-1]
    deltas = "".join(e.delta for e in call_events if e.type == "response.function_call_arguments.delta")
    assert call.type == "function_call" and deltas == call.arguments
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include[0]"),
        ({"input": "hi", "max_output_tokens": 5000}, 400, "max_output_tokens"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "strin"}}}},
            400,
            "text.format.schema",
        ),
    ],
)
def test_responses_bad_input_names_the_field(url, body, status, param):
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL} | body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    if status == 404:
        assert "resp_unknown" in r.json()["error"]["message"]


# ---- embeddings ----------------------------------------------------------------------------


def test_embeddings_equal_transformers_pooled_hidden_states(client, default_model_dir):
    """The default model (a decoder, no sentence-transformers pooling config) is pooled at its last token and
    normalised; texts, token ids, float and base64 (the SDK's default, decoded by it) all give the same vectors."""
    from transformers import AutoModel, AutoTokenizer

    texts = ["The cat sat on the mat.", "Ray schedules actors across a cluster of nodes, one per GPU."]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = [tokenizer.encode(t) for t in texts]
    model = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.nn.functional.normalize(model(torch.tensor([i])).last_hidden_state[0, -1], dim=0) for i in ids]
    as_base64, as_float, as_ids, one = concurrently(
        lambda: client.embeddings.create(model=MODEL, input=texts),
        lambda: client.embeddings.create(model=MODEL, input=texts, encoding_format="float"),
        lambda: client.embeddings.create(model=MODEL, input=ids),
        lambda: client.embeddings.create(model=MODEL, input=ids[1]),
    )
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in as_float.data] == [0, 1] and as_float.model == MODEL
    for got in (as_base64, as_float, as_ids):
        for d, w in zip(got.data, want):
            assert len(d.embedding) == w.shape[0]
            assert torch.tensor(d.embedding) == pytest.approx(w, abs=1e-4)
    assert torch.tensor(one.data[0].embedding) == pytest.approx(want[1], abs=1e-4)


def test_embeddings_are_counted_in_the_request_metrics(url):
    """Each input is a finished request in vLLM's series: its prompt tokens, a "stop" success and an e2e latency."""
    labels = f"model_name={MODEL}"
    key = f"vllm:request_success_total{{finished_reason=stop,{labels}}}"
    before = metrics(url)
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": ["one two", "three"]}, timeout=60)
    assert r.status_code == 200, r.text
    tokens = r.json()["usage"]["prompt_tokens"]
    e2e = f"vllm:e2e_request_latency_seconds_count{{{labels}}}"
    prompt = f"vllm:prompt_tokens_total{{{labels}}}"
    wait_metrics(
        url,
        lambda m: (
            m.get(key, 0) >= before.get(key, 0) + 2
            and m.get(prompt, 0) >= before.get(prompt, 0) + tokens
            and m.get(e2e, 0) >= before.get(e2e, 0) + 2
        ),
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "pooling": "cls"}, "pooling"),
        ({"input": ["a", "word " * 1100]}, "input[1]"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_field(url, body, param):
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
