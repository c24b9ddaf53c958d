"""GET /v1/models, and the LoRA adapter endpoints' bodies (vLLM's)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from serve.protocol.parsing import Strict


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "raylm"
    root: str
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1)
