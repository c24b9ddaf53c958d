"""What every response carries: its id and creation time, the token usage, and the streamed chunk's base."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, model_serializer


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


class StreamChunk(BaseModel):
    """A streamed chunk: ``usage`` appears only when set (as null or a count), as OpenAI streams do
    with and without ``stream_options.include_usage``."""

    @model_serializer(mode="wrap")
    def _usage_if_set(self, handler) -> dict[str, Any]:
        data = handler(self)
        if "usage" not in self.model_fields_set:
            data.pop("usage", None)
        return data
