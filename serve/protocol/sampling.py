"""What completions and chat share: sampling, stopping, constraint and scheduling fields, and their mapping onto
SamplingParams. vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, priority) take
vLLM's names and shapes."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.client import closed_schema
from scheduler import RequestError, SamplingParams, StructuredOutputsParams
from serve.protocol.parsing import APIError, Seed, Strict, TokenId, bad_request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


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
    disable_spec_decode: bool = Field(
        False,
        description=(
            "opts this request out of the server's speculative decoding (--speculative-config): no proposals are "
            "made or verified for it; the output is the same either way"
        ),
    )
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self, close_objects: bool = True) -> StructuredOutputsParams | None:
        """The output constraint of ``response_format`` or ``structured_outputs``; whether it compiles is the
        engine's check (``param_for`` names the field it came from). ``close_objects``: a JSON schema's objects
        that list properties admit no others unless they say so (``closed_schema``)."""
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
            return StructuredOutputsParams(json=closed_schema(rf.json_schema.schema_, close_objects))
        if so is None:
            return None
        try:
            return StructuredOutputsParams(
                json=closed_schema(so.json_, close_objects),
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=bool(so.json_object),
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
        close_objects: bool = True,
    ) -> SamplingParams:
        """``tool_constraint``: the grammar a forced tool_choice imposes (the server builds it from tools);
        ``bad_words_token_ids``: ``bad_words`` tokenized (by the server, which holds the tokenizer); ``defaults``:
        the model's sampling defaults (--generation-config), for the fields this request left unset;
        ``close_objects``: the server's structured_outputs_disable_additional_properties."""
        self.check_policy()
        constraint = self.constraint(close_objects)
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
                stop=self.stop_strings,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                ignore_eos=self.ignore_eos,
                n=self.n,
                logprobs=logprobs,
                logit_bias=self.logit_bias,
                prompt_logprobs=self.num_prompt_logprobs(),
                allowed_token_ids=self.allowed_token_ids,
                structured_outputs=constraint,
                bad_words_token_ids=bad_words_token_ids,
                disable_spec_decode=self.disable_spec_decode,
            )
        except RequestError as e:
            raise self.refusal(e) from None
