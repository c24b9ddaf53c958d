"""The bodies of the RL control routes (serve/controls.py): SGLang's names and fields, so a trainer written for
SGLang's HTTP API sends them unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serve.protocol.parsing import Strict, bad_request

Port = Field(ge=1, le=65535)


class UpdateWeightsFromDiskRequest(Strict):
    model_path: str = Field(min_length=1)
    flush_cache: bool = True
    weight_version: str | None = None


class InitWeightsUpdateGroupRequest(Strict):
    master_address: str = Field(min_length=1)
    master_port: int = Port
    rank_offset: int = Field(ge=1)  # rank 0 is the trainer's
    world_size: int = Field(ge=2)
    group_name: str = Field(min_length=1)
    backend: Literal["nccl", "gloo"] | None = None


class UpdateWeightsFromDistributedRequest(Strict):
    """One bucket of a broadcast: the tensors' names, dtypes ("bfloat16") and shapes, in the buffer's order."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(min_length=1)
    flush_cache: bool = True
    weight_version: str | None = None

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> UpdateWeightsFromDistributedRequest:
        for field in ("dtypes", "shapes"):
            if len(getattr(self, field)) != len(self.names):
                raise bad_request(
                    f"{field}: {len(getattr(self, field))} entries for {len(self.names)} names: one per tensor, "
                    "in the names' order",
                    field,
                )
        for i, shape in enumerate(self.shapes):
            if any(d < 0 for d in shape):
                raise bad_request(f"shapes[{i}]: {shape} has a negative dimension", f"shapes[{i}]")
        return self
