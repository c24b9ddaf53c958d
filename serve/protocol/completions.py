"""POST /v1/completions: the request, the response and its stream's chunks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from serve.protocol.output import StreamChunk, Usage
from serve.protocol.parsing import NumLogprobs, TokenId, bad_request
from serve.protocol.sampling import SamplingFields


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


class CompletionChunk(StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
