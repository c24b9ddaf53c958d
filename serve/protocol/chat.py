"""POST /v1/chat/completions: messages, tools, the request, the response and its stream's chunks."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from serve.protocol.output import StreamChunk, Usage
from serve.protocol.parsing import NumLogprobs, Strict, bad_request
from serve.protocol.sampling import SamplingFields


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls forced by tool_choice always follow parameters; auto ones are parsed as given


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    """A message of the history; fields it does not honour are refused, not dropped."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self, native_tools: bool = False) -> dict[str, Any]:
        """What chat templates expect: the content as one string. Earlier tool calls go as the template's
        ``tool_calls`` (arguments as objects) when it renders tools, else as Hermes text in the content."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": content} | ({"name": self.name} if self.name else {})
        calls = [
            {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)} for c in self.tool_calls or []
        ]
        if calls and native_tools:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": f} for c, f in zip(self.tool_calls, calls)
            ]
        elif calls:
            out["content"] = "\n".join(
                [content] * bool(content) + [f"<tool_call>\n{json.dumps(f)}\n</tool_call>" for f in calls]
            )
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` is the newer name for ``max_tokens``."""

    PROMPT_PARAM: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    """A whole reply's message: ``tool_calls`` appears only when the model called (OpenAI leaves it out)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_if_any(self, handler) -> dict[str, Any]:
        data = handler(self)
        if not self.tool_calls:
            data.pop("tool_calls", None)
        return data


class StreamedFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _drop_unset(self) -> dict[str, str]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class StreamedToolCall(BaseModel):
    """A chat stream's tool call delta: the first for a call carries its id and name, later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: StreamedFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A chat stream's delta: only the fields that are set appear (OpenAI sends role once, then content)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[StreamedToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
