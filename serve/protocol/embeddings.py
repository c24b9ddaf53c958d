"""POST /v1/embeddings: OpenAI's request and response."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator

from serve.protocol.parsing import Strict, TokenId


class EmbeddingRequest(Strict):
    """``input`` as OpenAI takes it: a text, texts, one token-id list, or token-id lists; none of them empty."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _nothing_empty(cls, value: str | list) -> str | list:
        if len(value) == 0:
            raise ValueError("the input must not be empty")
        if isinstance(value, list) and any(isinstance(v, (str, list)) and len(v) == 0 for v in value):
            raise ValueError("no input may be empty")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding asked for."""
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]
        return list(value)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values, little-endian, as OpenAI encodes them


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
