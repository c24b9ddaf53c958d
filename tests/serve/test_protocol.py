"""The wire format and the app's configuration, without a server: validation errors name the
parameter, requests map onto SamplingParams, chunks serialize as OpenAI's do, and the CLI and the
Serve config reach the deployment options."""

import json
import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

import cli
from engine.config import EngineConfig
from engine.request_check import check_constraint
from scheduler import RequestError, StructuredOutputsParams
from serve import AppArgs, build_app, deployment_options
from serve.drain import MARGIN_S
from serve.protocol.chat import ChatCompletionChunk, ChatCompletionRequest, ChatStreamChoice, Delta
from serve.protocol.completions import CompletionChunk, CompletionRequest
from serve.protocol.output import Usage
from serve.protocol.parsing import APIError, parse

SERVE_CONFIG = Path(__file__).parents[2] / "manifests" / "serve_config.yaml"


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "top_p": 2}, "top_p"),
        (CompletionRequest, {"prompt": [1, -2]}, "prompt"),
        (CompletionRequest, {}, "prompt"),
        (CompletionRequest, "a string", None),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
            "messages[1].role",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls[0].function",
        ),
    ],
)
def test_validation_errors_are_400_naming_the_parameter(model, body, param):
    with pytest.raises(APIError) as e:
        parse(model, body)
    assert (e.value.status, e.value.param, e.value.type) == (400, param, "invalid_request_error")
    assert e.value.message.startswith(param or "body")


SAMPLING = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "presence_penalty": 0.3,
    "frequency_penalty": -0.4,
    "repetition_penalty": 1.2,
    "seed": 3,
    "stop_token_ids": [5, 6],
    "ignore_eos": True,
    "n": 2,
    "min_tokens": 1,
    "disable_spec_decode": True,
}  # distinct values, so that a swap of two fields fails


def test_sampling_params_mapping():
    req = parse(CompletionRequest, {"prompt": "x", "stop": "END", "logprobs": 4} | SAMPLING)
    params = req.sampling_params(max_tokens=7, logprobs=req.logprobs)
    assert {k: getattr(params, k) for k in SAMPLING} == SAMPLING
    assert (params.max_tokens, params.logprobs) == (7, 4)
    assert req.stop_strings == ["END"]
    assert parse(CompletionRequest, {"prompt": "x", "top_k": 0}).sampling_params(7, None).top_k == -1  # vLLM's "off"


def test_chat_sampling_params_mapping():
    req = parse(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 3} | SAMPLING,
    )
    params = req.sampling_params(max_tokens=7, logprobs=req.num_logprobs)
    assert {k: getattr(params, k) for k in SAMPLING} == SAMPLING
    assert params.logprobs == 3


def test_what_only_sampling_params_checks_is_still_a_400():
    req = parse(CompletionRequest, {"prompt": "x", "min_tokens": 9})
    with pytest.raises(APIError) as e:
        req.sampling_params(max_tokens=4, logprobs=None)
    assert (e.value.status, e.value.param) == (400, "min_tokens")


def test_single_prompt_unwraps_a_one_element_batch():
    assert parse(CompletionRequest, {"prompt": [[1, 2]]}).single_prompt() == [1, 2]
    assert parse(CompletionRequest, {"prompt": ["hi"]}).single_prompt() == "hi"


def test_chat_fields():
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 3,
            "logprobs": True,
        },
    )
    assert req.requested_max_tokens == 3
    assert req.num_logprobs == 0
    assert req.messages[0].template_dict() == {"role": "user", "content": "ab"}


def test_stream_chunks_carry_usage_only_when_asked():
    assert "usage" not in CompletionChunk(id="a", created=0, model="m", choices=[]).model_dump()
    assert CompletionChunk(id="a", created=0, model="m", choices=[], usage=None).model_dump()["usage"] is None
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    assert (
        ChatCompletionChunk(id="a", created=0, model="m", choices=[], usage=usage).model_dump()["usage"]["total_tokens"]
        == 3
    )


def test_chat_deltas_show_only_what_is_set():
    choice = ChatStreamChoice(index=0, delta=Delta(content="hi"))
    assert choice.model_dump()["delta"] == {"content": "hi"}
    assert Delta(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}


def test_api_errors_survive_pickling():  # they cross Ray when a gRPC stream fails
    e = pickle.loads(pickle.dumps(APIError(404, "no such model", "model", "model_not_found")))
    assert (e.status, e.message, e.param, e.code, e.type) == (
        404,
        "no such model",
        "model",
        "model_not_found",
        "invalid_request_error",
    )


# ---- configuration ------------------------------------------------------------------------------


def test_autoscaling_defaults_follow_the_batch_size():
    opts = deployment_options(AppArgs.from_flat({"max_num_seqs": 64, "max_replicas": 4}))
    assert opts["max_ongoing_requests"] == 3 * 64  # 64 running, 64 queued, room for what the replica refuses
    assert opts["autoscaling_config"] == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 32,
    }


def test_flat_args_split_between_engine_and_app():
    args = AppArgs.from_flat(
        {
            "model": "/m",
            "tensor_parallel_size": "2",
            "api_key": "k",
            "target_ongoing_requests": "10",
            "max_ongoing_requests": 20,
        }
    )
    assert (args.engine.model, args.engine.tensor_parallel_size, args.api_key) == ("/m", 2, "k")
    opts = deployment_options(args)
    assert (opts["autoscaling_config"]["target_ongoing_requests"], opts["max_ongoing_requests"]) == (10, 20)
    with pytest.raises(ValidationError):
        AppArgs.from_flat({"max_replica": 2})


def test_the_serve_config_is_valid_and_builds():
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "serve:build_app"
    assert config.grpc_options.grpc_servicer_functions == ["serve.raylm_pb2_grpc.add_RayLMServicer_to_server"]
    opts = deployment_options(AppArgs.from_flat(app.args))
    assert opts["autoscaling_config"]["max_replicas"] == app.args["max_replicas"]
    assert build_app(app.args) is not None


def test_cli_serve_reaches_the_app_args(monkeypatch):
    seen = {}
    monkeypatch.setattr(EngineConfig, "resolved_model", lambda self: "/resolved")  # /m need not exist
    monkeypatch.setattr("serve.serve_until_interrupted", lambda args, **kw: seen.update(args=args, **kw))
    monkeypatch.setenv("RAYLM_API_KEY", "from-env")
    cli.main(
        [
            "serve",
            "--model",
            "/m",
            "--tensor-parallel-size",
            "2",
            "--max-num-seqs",
            "32",
            "--min-replicas",
            "2",
            "--max-replicas",
            "5",
            "--port",
            "8123",
            "--host",
            "0.0.0.0",
            "--grpc-port",
            "9123",
            "--max-queue-len",
            "4",
            "--request-timeout-s",
            "30",
            "--step-timeout-s",
            "60",
            "--health-check-period-s",
            "2.5",
            "--drain-timeout-s",
            "12",
        ]
    )
    args = seen["args"]
    assert (args.engine.model, args.engine.tensor_parallel_size, args.engine.max_num_seqs) == ("/m", 2, 32)
    assert (args.max_queue_len, args.request_timeout_s, args.engine.step_timeout_s) == (4, 30, 60)
    assert (args.min_replicas, args.max_replicas, args.api_key) == (2, 5, "from-env")
    assert (seen["host"], seen["port"], seen["grpc_port"], seen["address"]) == ("0.0.0.0", 8123, 9123, None)
    opts = deployment_options(args)
    assert (opts["max_ongoing_requests"], opts["autoscaling_config"]["target_ongoing_requests"]) == (2 * 32 + 4, 16)
    assert opts["health_check_period_s"] == 2.5
    # Serve kills a stopping replica only after the replica's own drain deadline has answered its clients.
    assert (args.drain_timeout_s, opts["graceful_shutdown_timeout_s"]) == (12, 12 + MARGIN_S)


def test_unknown_fields_are_refused_and_harmless_ones_accepted():
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"prompt": "x", "prediction": {"type": "content", "content": "y"}})
    assert (e.value.code, e.value.param) == ("unsupported_field", "prediction")
    assert "does not support" in e.value.message
    with pytest.raises(APIError) as e:  # nested objects too: vLLM's whitespace knob is not honoured
        parse(CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}})
    assert (e.value.code, e.value.param) == ("unsupported_field", "structured_outputs.whitespace_pattern")
    with pytest.raises(APIError) as e:  # the opt-out of speculative decoding is disable_spec_decode
        parse(CompletionRequest, {"prompt": "x", "speculative": False})
    assert (e.value.code, e.value.param) == ("unsupported_field", "speculative")
    req = parse(CompletionRequest, {"prompt": "x", "user": "u", "metadata": {"k": "v"}, "store": False})
    assert req.metadata == {"k": "v"}


CHAT = {"messages": [{"role": "user", "content": "a"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CLOSED = SCHEMA | {"additionalProperties": False}  # as vLLM's default backend reads SCHEMA


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=CLOSED),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=CLOSED)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=CLOSED)),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputsParams(grammar='start: "a"+')),
    ],
)
def test_constraints_reach_sampling_params(body, expected):
    assert parse(ChatCompletionRequest, CHAT | body).sampling_params(8, None).structured_outputs == expected


def test_literal_schemas_are_kept_when_the_server_says_so():
    body = CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}
    params = parse(ChatCompletionRequest, body).sampling_params(8, None, close_objects=False)
    assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA)
    text = parse(ChatCompletionRequest, CHAT | {"structured_outputs": {"json": "{not json"}}).sampling_params(8, None)
    assert text.structured_outputs == StructuredOutputsParams(json="{not json")  # left for the engine's check


def test_sampling_fields_reach_sampling_params():
    params = parse(
        CompletionRequest,
        {"prompt": "x", "logit_bias": {"5": -100, "7": 2.5}, "allowed_token_ids": [5, 7], "best_of": 2, "n": 2},
    ).sampling_params(8, None)
    assert (params.logit_bias, params.allowed_token_ids, params.n) == ({5: -100.0, 7: 2.5}, [5, 7], 2)


@pytest.mark.parametrize(
    ("model", "body", "param", "says"),
    [
        (
            ChatCompletionRequest,
            CHAT
            | {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            "strin",
        ),
        (
            ChatCompletionRequest,
            CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema",
            "schema",
        ),
        (
            ChatCompletionRequest,
            CHAT | {"structured_outputs": {"regex": "a(b"}},
            "structured_outputs.regex",
            "unclosed",
        ),
        (
            ChatCompletionRequest,
            CHAT | {"structured_outputs": {"grammar": "start: x"}},
            "structured_outputs.grammar",
            "unknown name",
        ),
        (
            ChatCompletionRequest,
            CHAT | {"structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
            "not valid JSON",
        ),
        (
            ChatCompletionRequest,
            CHAT | {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (ChatCompletionRequest, CHAT | {"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        (
            ChatCompletionRequest,
            CHAT | {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "send one",
        ),
        (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of", "n=1"),
        (CompletionRequest, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "20"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "100"),
        (CompletionRequest, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "at least 1"),
    ],
)
def test_the_field_policy_refuses_with_a_400_naming_the_field(model, body, param, says):
    """What the request itself refuses, or the engine's check of its constraint (a RequestError, which the
    replica turns into this request's 400 the same way)."""
    with pytest.raises(APIError) as e:
        req = parse(model, body)
        constraint = req.sampling_params(8, None).structured_outputs
        try:
            check_constraint(constraint) if constraint is not None else None
        except RequestError as refused:
            raise req.refusal(refused) from None
    assert (e.value.status, e.value.param) == (400, param)
    assert says in e.value.message


@pytest.mark.parametrize(
    ("model", "body", "field", "param"),
    [
        (CompletionRequest, {"prompt": [1, 2]}, "prompt[1]", "prompt"),
        (ChatCompletionRequest, CHAT, "prompt", "messages"),
        (ChatCompletionRequest, CHAT, "prompt_logprobs", "prompt_logprobs"),
        (CompletionRequest, {"prompt": "x", "bad_words": ["a"]}, "bad_words_token_ids", "bad_words"),
        (
            CompletionRequest,
            {"prompt": "x", "structured_outputs": {"regex": "("}},
            "structured_outputs.regex",
            "structured_outputs.regex",
        ),
        (
            ChatCompletionRequest,
            CHAT | {"response_format": {"type": "json_object"}},
            "structured_outputs.json_object",
            "response_format",
        ),
        (
            ChatCompletionRequest,
            CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "structured_outputs.json",
            "tools",
        ),
    ],
)
def test_an_engine_refusal_names_the_requests_own_parameter(model, body, field, param):
    assert parse(model, body).param_for(field) == param


def test_prompt_logprobs_asked_directly_or_by_echo_with_logprobs_take_the_larger_top_k():
    def asked(body):
        req = parse(CompletionRequest, {"prompt": "x"} | body)
        return req.sampling_params(8, req.logprobs).prompt_logprobs

    assert asked({}) is None and asked({"logprobs": 3}) is None and asked({"echo": True}) is None
    assert asked({"echo": True, "logprobs": 3}) == 3 and asked({"prompt_logprobs": 0}) == 0
    assert asked({"echo": True, "logprobs": 2, "prompt_logprobs": 5}) == 5
