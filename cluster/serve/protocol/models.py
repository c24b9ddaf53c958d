"""GET /v1/models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


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
