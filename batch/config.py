"""A processor's settings: its engine's and the pool's. Importing them loads no Ray or Arrow (`raylm --help`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engine.config import EngineConfig


class BatchConfig(BaseModel):
    """A processor: the engine each actor of the pool runs (every setting the server takes), how many engines,
    and how rows reach them. An actor takes ``batches_in_flight`` batches of ``batch_size`` rows at once and
    submits their rows together, up to the engine's max_num_seqs, so its queue never runs dry between batches."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    concurrency: int = Field(1, ge=1, description="engines: the actor pool's fixed size, each engine its own ranks")
    batch_size: int = Field(16, ge=1, description="rows per batch handed to a stage")
    batches_in_flight: int = Field(4, ge=1, description="batches one engine actor runs at once")
    tokenize_concurrency: int = Field(1, ge=1, description="actors of the tokenize and detokenize stages, each")
