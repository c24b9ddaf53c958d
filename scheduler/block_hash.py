"""Chained content hashes of full KV blocks, the keys of the prefix cache."""

from __future__ import annotations

import array

import xxhash

BlockHash = bytes  # 16 bytes of xxh3_128
_digest = xxhash.xxh3_128_digest


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extra: str | None = None) -> BlockHash:
    """Hash one full block: parent hash, then the token ids as int64 bytes, then any extra key.

    Chaining the parent in makes a block's hash name its whole prefix, so equal
    tokens after different prefixes never share a cache entry. The cache salt
    (``extra``) only needs to enter the first block: the chain carries it on.
    """
    data = array.array("q", token_ids).tobytes()
    if parent is not None:
        data = parent + data
    if extra is not None:
        data += extra.encode()
    return _digest(data)  # one-shot over the concatenation: the same digest as streaming, fewer calls


def first_block_key(cache_salt: str | None, lora_name: str | None) -> str | None:
    """The extra key hashed into block 0 (the chain carries it on): the cache salt, and the LoRA adapter, whose
    KV differs from the base model's for equal text. Without an adapter it is the salt alone."""
    if lora_name is None:
        return cache_salt
    return f"{cache_salt or ''}\0lora:{lora_name}"


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], block_size: int, key: str | None) -> None:
    """Append to ``hashes`` (the chain of the leading full blocks of ``token_ids``) the hashes of the full blocks
    after them; ``key`` (first_block_key) enters block 0."""
    parent = hashes[-1] if hashes else None
    extra = key if not hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        extra = None
        hashes.append(parent)
