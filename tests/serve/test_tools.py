"""Tool calling without a server: tool_choice checks, the constraint a forced call gets, and calls read back
from text whole and streamed (Hermes/Qwen and Llama 3 formats)."""

import json
from enum import Enum

import llguidance
import llguidance.hf
import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from serve.protocol.chat import ChatCompletionRequest, NamedToolChoice, Tool
from serve.protocol.parsing import APIError, parse
from serve.tools import HERMES, LLAMA3, ToolCalling, ToolCallStream
from workers.grammars import compile_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
QWEN_TEMPLATE = "{% if tools %}...{% endif %}<tool_call>"  # what the formats are picked by
LLAMA_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}"


def calling(choice="auto", template=None, parallel=None) -> ToolCalling:
    return ToolCalling.from_request(TOOLS, choice, parallel, template)


def test_formats_follow_the_chat_template():
    assert (calling(template=QWEN_TEMPLATE).fmt, calling(template=QWEN_TEMPLATE).native) == (HERMES, True)
    assert (calling(template=LLAMA_TEMPLATE).fmt, calling(template=LLAMA_TEMPLATE).native) == (LLAMA3, True)
    assert (calling(template="{{ messages }}").fmt, calling().native) == (HERMES, False)
    assert calling("none") is None and ToolCalling.from_request(None, None, None, None) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]} | body)
        ToolCalling.from_request(req.tools, req.tool_choice, req.parallel_tool_calls, None)
    assert (e.value.status, e.value.param) == (400, param)


def test_hermes_calls_are_read_from_whole_text():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    content, calls = calling().parse(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c.id for c in calls}) == 2
    assert [c.function.name for c in calling(parallel=False).parse(text)[1]] == ["get_weather"]
    assert calling().parse("no calls <tool_call> {broken") == ("no calls <tool_call> {broken", [])


def test_llama3_calls_are_read_from_whole_text():
    content, calls = calling(template=LLAMA_TEMPLATE).parse(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}'
    )
    assert content is None and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {"zone": "UTC"}
    assert calling(template=LLAMA_TEMPLATE).parse("Just text.") == ("Just text.", [])


STREAMED = (
    'Sure. <tool_call>\n{"name": "get_time", "arguments":  {"zone": "CET", "at": {"h": 1}}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAMED)])
def test_streamed_calls_send_id_and_name_then_arguments_however_the_text_is_cut(size):
    stream = ToolCallStream(calling())
    content, deltas = "", []
    for i in range(0, len(STREAMED), size):
        content += stream.feed(STREAMED[i : i + size])
        deltas += stream.take_deltas()
    content += stream.finish()
    deltas += stream.take_deltas()
    assert content == "Sure. "
    for index, (name, args) in enumerate(
        [("get_time", {"zone": "CET", "at": {"h": 1}}), ("get_weather", {"city": "Oslo"})]
    ):
        mine = [d for d in deltas if d.index == index]
        head, rest = mine[0], mine[1:]
        assert (head.function.name, head.function.arguments) == (name, "") and head.id.startswith("call_")
        assert rest and all(d.id is None and d.function.name is None for d in rest)
        streamed = "".join(d.function.arguments for d in rest)
        assert json.loads(streamed) == args and streamed == streamed.strip()  # the same text however it is cut
    if size == 1:  # the first call's arguments arrived in pieces, before its end tag
        assert len([d for d in deltas if d.index == 0]) > 2


@pytest.mark.parametrize("template", [None, LLAMA_TEMPLATE])
def test_a_forced_choice_admits_exactly_calls_of_its_tools(default_model_dir, template):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    lltok = llguidance.hf.from_tokenizer(tok)
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    key = "parameters" if template else "arguments"

    def accepts(choice, text: str, parallel=None, close_objects=True) -> bool:
        grammar = compile_grammar(calling(choice, template, parallel).constraint(close_objects))
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    def call(name, args) -> str:
        body = json.dumps({"name": name, key: args})
        return body if template else f"<tool_call>\n{body}\n</tool_call>"

    weather, zone = call("get_weather", {"city": "Oslo", "unit": "c"}), call("get_time", {"zone": "CET"})
    assert accepts("required", weather) and accepts("required", zone)
    assert accepts("required", weather + "\n" + zone)
    assert not accepts("required", weather + "\n" + zone, parallel=False)
    assert accepts(named, zone) and not accepts(named, weather)
    assert not accepts(named, zone + "\n" + zone)  # a named choice is one call
    assert not accepts("required", call("get_weather", {"city": "Oslo"}))  # a required argument missing
    assert not accepts("required", "I would rather chat.")
    extra = call("get_time", {"zone": "CET", "dst": True})  # the parameters list no "dst" nor additionalProperties
    assert not accepts(named, extra) and accepts(named, extra, close_objects=False)
    assert calling("auto").constraint() is None


class Role(str, Enum):
    admin = "admin"
    user = "user"


class Member(BaseModel):
    name: str
    role: Role  # pydantic puts Role under $defs and points at it with "#/$defs/Role"


@pytest.mark.parametrize("template", [None, LLAMA_TEMPLATE])
def test_pydantic_parameters_with_defs_compile_and_admit_their_calls(default_model_dir, template):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    member = Tool.model_validate(
        {"type": "function", "function": {"name": "add_member", "parameters": Member.model_json_schema()}}
    )
    forced = ToolCalling.from_request([member, TOOLS[1]], "required", False, template)
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), compile_grammar(forced.constraint()), log_level=0)
    body = json.dumps({"name": "add_member", "parameters" if template else "arguments": {"name": "Al", "role": "user"}})
    text = body if template else f"<tool_call>\n{body}\n</tool_call>"
    assert m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()
