"""The scheduler's only door to KV memory: prefix lookup, slot allocation, freeing."""

from __future__ import annotations

from scheduler.block_pool import BlockPool, KVCacheBlock
from scheduler.request import Request


class KVCacheManager:
    """Maps each request to its block table and keeps the prefix cache honest.

    Invariants:
    - ``req_to_blocks[r]`` covers at least ``r.num_computed_tokens`` tokens
      (``len * block_size >= num_computed_tokens``).
    - A block gets its hash only after the step that computed its KV has
      returned (``cache_computed_blocks``), so a hit never reads KV that a
      failed or preempted step left unwritten.
    - ``num_cached_blocks[r]`` blocks at the head of r's table are hashed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    def usage(self) -> float:
        return self.block_pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached blocks for the request's tokens, capped so the last token is computed.

        The cap (num_tokens - 1) exists because the model must run on at least
        one token to produce logits for the next one.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        lookup = self.block_pool.get_cached_block
        for block_hash in request.block_hashes[:max_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup: once per admission, not per attempt, or waiting inflates the stats."""
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and the cache hits).

        Returns the newly allocated blocks (possibly none), or None — touching
        nothing — when the pool cannot hold them; the caller then preempts.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        hits = new_computed_blocks or ()
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_needed = -(-num_tokens // self.block_size) - len(blocks) - len(hits)
        pool = self.block_pool
        if num_needed <= 0 and not hits:
            return []  # the decode fast path: the last block still has room
        # Hits that sit in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_needed, 0) + num_evictable_hits > pool.num_free_blocks:
            return None
        if hits:
            pool.touch(hits)
            blocks.extend(hits)
            self.num_cached_blocks[request.request_id] = len(blocks)
        if num_needed <= 0:
            return []
        new_blocks = pool.get_new_blocks(num_needed)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's blocks that are now full and computed into the prefix cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(rid)
        if num_cached is None or num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(self.req_to_blocks[rid], request.block_hashes, num_cached, num_full)
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its shared prompt head is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
