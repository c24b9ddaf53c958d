"""The OpenAI-compatible wire format: request models (validated, naming the bad field), response
models, and error bodies. vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, priority, /tokenize, /detokenize) take vLLM's names and shapes."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from scheduler import RequestError, SamplingParams, StructuredOutputsParams

M = TypeVar("M", bound=BaseModel)
TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what torch.Generator.manual_seed takes (plus n offsets)
NumLogprobs = Annotated[int, Field(ge=0, le=20)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the client gets as an OpenAI-style JSON body with this HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "internal_server_error")

    def __reduce__(self):  # picklable with all its fields: it crosses Ray (a gRPC stream's error does)
        return APIError, (self.status, self.message, self.param, self.code, self.type)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def parse(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its parameter."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param_path(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(
                f"{param}: this server does not support this field; leave it out", param, "unsupported_field"
            ) from None
        raise bad_request(f"{param or 'body'}: {err['msg']} (got {_short(err.get('input'))})", param) from None


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """("messages", 1, "role") -> "messages[1].role", leaving out the union-member tags pydantic puts in
    locations ("str", "list[constrained-int]"), which are no parameter names."""
    parts = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if isinstance(p, int) or (p.isidentifier() and p not in _UNION_TAGS)
    ]
    return "".join(parts).lstrip(".") or None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchema(Strict):
    """``response_format.json_schema``. Output is always held to ``schema`` (``strict`` or not): a model
    this small follows no schema unless forced, and a constraint accepted but not enforced fails open."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputsRequest(Strict):
    """vLLM's ``structured_outputs`` extra field: one of json (a schema), json_object, regex, choice,
    grammar (Lark or GBNF). vLLM's tuning knobs (whitespace, fallback, structural tags) are refused."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(BaseModel):
    """What completions and chat share: sampling, stopping, constraint and scheduling knobs.

    The field policy, for every request model here: a field is honoured, or
    refused with a 400 that names it, never dropped (a constraint silently
    ignored fails open).
    - Unknown fields: refused (``extra="forbid"``, code ``unsupported_field``),
      in nested objects too.
    - Refused values, each with its reason in the field's description (and so
      in /openapi.json): ``best_of`` other than ``n``, any ``suffix``,
      ``logprobs``/``top_logprobs``/``prompt_logprobs`` above 20, ``priority``
      under fcfs.
    - Accepted without behaviour: ``user``, ``metadata``, ``store`` (OpenAI
      bookkeeping that changes no output).
    Ranges are checked here so that each error names the field; SamplingParams
    re-checks them, and the engine checks what needs the model (token ids
    against the vocabulary, the prompt against the context, whether a
    constraint compiles): their RequestError becomes a 400 the same way, its
    field mapped back to this request's parameter by ``param_for``.
    """

    PROMPT_PARAM: ClassVar[str] = "prompt"

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=128)  # OpenAI's cap; each sample is a sequence in the batch
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # -1 and 0 both mean off, as in vLLM
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    cache_salt: str | None = Field(
        None,
        min_length=1,
        description=(
            "mixed into the prefix-cache hash of the prompt's first block: only requests with the same salt "
            "share cached blocks"
        ),
    )
    best_of: int | None = Field(None, ge=1, description="accepted only when equal to n (no server-side ranking)")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint of ``response_format`` or ``structured_outputs``; whether it compiles is the
        engine's check (``param_for`` names the field it came from)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise bad_request(
                "response_format and structured_outputs both constrain the output; send one", "structured_outputs"
            )
        if rf is not None and rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request(
                    "response_format: type json_schema needs json_schema.schema", "response_format.json_schema"
                )
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        if so is None:
            return None
        try:
            return StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object)
            )
        except RequestError as e:
            raise bad_request(f"structured_outputs: {e}", "structured_outputs") from None

    def refusal(self, e: RequestError) -> APIError:
        """The 400 for a RequestError of this request's SamplingParams or of the engine's check."""
        return bad_request(str(e), self.param_for(e.field))

    def param_for(self, field: str) -> str:
        """This request's parameter behind a RequestError's field (SamplingParams' names, or the engine check's:
        ``prompt[i]``, ``structured_outputs.regex``)."""
        if field == "prompt" or field.startswith("prompt["):
            return self.PROMPT_PARAM
        if field.startswith("structured_outputs") and self.structured_outputs is None:
            rf = self.response_format
            if rf is not None and rf.type != "text":
                return "response_format.json_schema.schema" if rf.type == "json_schema" else "response_format"
            return "tools"  # a forced tool call's constraint, built from the tools' parameters
        return "bad_words" if field == "bad_words_token_ids" else field

    def check_policy(self) -> None:
        """Values the server refuses although their field exists (see the class docstring)."""
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"best_of={self.best_of}: only best_of equal to n={self.n} is supported "
                f"(this server does not rank samples)",
                "best_of",
            )

    def num_prompt_logprobs(self) -> int | None:
        """The top-k of the prompt's logprobs the engine computes (None: none)."""
        return None

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        tool_constraint: StructuredOutputsParams | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """``tool_constraint``: the grammar a forced tool_choice imposes (the server builds it from tools);
        ``bad_words_token_ids``: ``bad_words`` tokenized (by the server, which holds the tokenizer); ``defaults``:
        the model's sampling defaults (--generation-config), for the fields this request left unset."""
        self.check_policy()
        constraint = self.constraint()
        if tool_constraint is not None:
            if constraint is not None:
                raise bad_request(
                    "tool_choice forces a tool call, which response_format or structured_outputs "
                    "would constrain as well; send one",
                    "tool_choice",
                )
            constraint = tool_constraint
        sampling = {
            name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        sampling.update({k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set})
        try:
            return SamplingParams(
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=-1 if sampling["top_k"] == 0 else sampling["top_k"],
                min_p=sampling["min_p"],
                repetition_penalty=sampling["repetition_penalty"],
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                n=self.n,
                logprobs=logprobs,
                logit_bias=self.logit_bias,
                prompt_logprobs=self.num_prompt_logprobs(),
                allowed_token_ids=self.allowed_token_ids,
                structured_outputs=constraint,
                bad_words_token_ids=bad_words_token_ids,
            )
        except RequestError as e:
            raise self.refusal(e) from None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt`` is text or token ids (one prompt, or a list holding one)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: NumLogprobs | None = None
    echo: bool = Field(
        False,
        description="the prompt's text in front of each choice's; with logprobs, "
        "logprobs cover the prompt's tokens too (the first one's null)",
    )
    suffix: None = Field(None, description="refused: this server does not do insertion (fill in the middle)")
    prompt_logprobs: NumLogprobs | None = Field(
        None,
        description="vLLM's: each choice's prompt_logprobs lists, for each prompt token after the first, "
        "its logprob, rank and the top prompt_logprobs alternatives (the prefix cache is not used)",
    )

    def num_prompt_logprobs(self) -> int | None:
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return p
        if len(p) != 1:
            raise bad_request(f"prompt: got {len(p)} prompts; send one prompt per request", "prompt")
        return p[0]


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


class TokenizeCompletionRequest(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(BaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses -------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """With echo, the prompt's tokens lead; the first one's logprob and top_logprobs are null (OpenAI's)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs``, keyed by token id."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


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


class StreamChunk(BaseModel):
    """A streamed chunk: ``usage`` appears only when set (as null or a count), as OpenAI streams do
    with and without ``stream_options.include_usage``."""

    @model_serializer(mode="wrap")
    def _usage_if_set(self, handler) -> dict[str, Any]:
        data = handler(self)
        if "usage" not in self.model_fields_set:
            data.pop("usage", None)
        return data


class ChatCompletionChunk(StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "raylm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
