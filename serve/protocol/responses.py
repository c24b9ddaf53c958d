"""POST /v1/responses: the request (input text or items, instructions, function tools, text.format, a previous
response to continue), its conversion into the chat request the engine path already serves, and the response
object with its items and usage. Field names and shapes are OpenAI's Responses API as the openai SDK sends and
parses them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from serve.protocol.chat import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from serve.protocol.parsing import APIError, Strict, parse

ITEM_TYPES = ("message", "function_call", "function_call_output")


class InputText(BaseModel):
    """A message's text part: ``input_text`` as sent, ``output_text`` in an earlier response's message sent back
    (its annotations and logprobs are the earlier output's and change nothing)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    """A message of the input: the SDK's EasyInputMessage (no ``type``) or an output message sent back (``id`` and
    ``status`` are the earlier response's)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    """A call the model made in an earlier turn, sent back with its result."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="unsupported_item",
        custom_error_message=f"this server takes input items of the types {', '.join(ITEM_TYPES)}",
    ),
]


class FunctionTool(Strict):
    """A function tool, flat as the Responses API sends it (chat nests it under ``function``)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """``text.format``: free text, any JSON object, or a JSON schema (flat, where chat nests it under
    ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class Reasoning(Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


# `include` values naming output raylm never produces (no reasoning items, no built-in tools, text-only input):
# honoured by adding nothing. The Agents SDK sends `include` on every request.
VACUOUS_INCLUDES = (
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)


class ResponsesRequest(Strict):
    """POST /v1/responses. Unknown fields, other tool types and other input item types are a 400 naming them.
    ``reasoning`` is accepted and ignored, as vLLM does for a model without a reasoning parser: the model has no
    reasoning to configure or summarise. ``store`` (default true, as OpenAI's) keeps the response on this replica
    for ``previous_response_id`` (serve/response_store.py)."""

    model: str | None = None
    input: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[InputItem], Tag("list[item]")],
        Discriminator(lambda v: "str" if isinstance(v, str) else "list[item]"),  # a list: its items name the error
    ]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    reasoning: Reasoning | None = Field(None, description="accepted and ignored: this model does not reason")
    truncation: Literal["disabled"] | None = Field(None, description="only disabled: an input too long is a 400")
    include: list[Literal[VACUOUS_INCLUDES]] | None = Field(  # type: ignore[valid-type]
        None,
        description="extra output OpenAI adds on request: those of reasoning, tool kinds and input items this server "
        "never produces are accepted (there is nothing to add); message.output_text.logprobs is a 400",
    )
    metadata: dict[str, str] | None = None
    user: str | None = None

    def input_messages(self) -> list[ChatMessage]:
        """This request's input as chat messages: calls sent back join one assistant message, their outputs are
        tool messages."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        out: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                    out[-1].tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
        return out

    def chat_request(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this one runs as: instructions (never carried over from earlier responses), the stored
        conversation ``history``, then this input."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.input_messages(),
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        fields |= {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.name is None or fmt.schema_ is None:
                raise APIError(400, "text.format: type json_schema needs name and schema", "text.format")
            schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            fields["response_format"] = {"type": fmt.type}
        return parse(ChatCompletionRequest, fields)


# The chat request's parameters, as this request names them: a refusal of the chat path names the field sent.
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
}


def responses_error(e: APIError) -> APIError:
    """A refusal of the chat path, naming the Responses field (in ``param`` and at the head of the message)."""
    param = CHAT_TO_RESPONSES.get(e.param, e.param) if e.param else e.param
    message = param + e.message.removeprefix(e.param) if e.param and e.message.startswith(e.param) else e.message
    return APIError(e.status, message, param, e.code, e.type)


# ---- the response ----------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """The response object: what ``responses.create`` returns and ``response.created``/``completed`` carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning | None
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
