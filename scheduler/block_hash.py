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
