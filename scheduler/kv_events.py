"""KV-cache events: which block hashes entered and left each tier's prefix cache, in the order they did.

Plain records, collected by the block pools while the scheduler runs and taken once per engine step
(``KVCacheManager.take_events``); engine/kv_events.py puts them on the wire in vLLM's format, so the
routers that read vLLM's events (llm-d, NVIDIA Dynamo) learn where raylm's prefixes live.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.block_hash import BlockHash

# The tiers as vLLM's events name them (routers map "GPU" to the first tier): the device pool is "GPU" on a CPU
# engine too, because it is the tier the model reads.
DEVICE = "GPU"
HOST = "CPU"


@dataclass(slots=True)
class BlockStored:
    """Hashes that entered one tier's cache, a chain: ``block_hashes[0]``'s parent is ``parent_block_hash`` (None: it
    is its prompt's first block), each next hash's parent the one before it. ``token_ids`` holds the blocks' tokens,
    ``block_size`` per hash, on the device tier; a host-tier copy names its hashes only (parent None, no tokens), as
    vLLM's offloaded tier does."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    medium: str
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Hashes that left one tier's cache: the last block holding each was evicted."""

    block_hashes: list[BlockHash]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    """Every tier is empty: the first event of a new engine, so a router drops what an endpoint's previous engine
    held."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
