"""vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from pydantic import BaseModel, Field

from serve.protocol.chat import ChatMessage
from serve.protocol.parsing import TokenId


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
