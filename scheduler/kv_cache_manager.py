"""The scheduler's only door to KV memory: prefix lookup, slot allocation, freeing, and the host tier."""

from __future__ import annotations

from scheduler.block_hash import BlockHash
from scheduler.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_events import DEVICE, HOST, AllBlocksCleared, BlockStored, KVEvent
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

    The host tier (``num_host_blocks > 0``) is a second pool in host memory.
    It holds the blocks of requests preempted by swap (``req_to_host_blocks``:
    a request is in at most one of the two tables) and, as a second level of
    the prefix cache, the content of hashed device blocks the device pool
    evicts. Each step's copies accumulate in ``blocks_to_swap_out`` (device id,
    host id) and ``blocks_to_swap_in`` (host id, device id) until ``take_swaps`` hands them to the
    step; the workers run every swap-out, then every swap-in, then the
    forward. That order is safe because:
    - a device block is swapped out only while its content is still its own
      (a victim's, or an evicted hash's), before this step's forward or a
      swap-in can write it;
    - a host block a step copies from or to stays referenced (``held``) until
      the step's plan is final, so no other copy of the same step targets it.

    With ``enable_events`` (and caching), ``events`` lists, in order, every hash
    that entered or left either tier's cache since ``take_events`` last ran,
    after an AllBlocksCleared (the cache starts empty): replaying them gives
    exactly each pool's ``cached_blocks`` keys.

    ``reset_prefix_cache`` forgets every hash of both tiers, live requests or not (vLLM refuses while blocks are in
    use; here it always succeeds): the live ones keep their blocks and go on reading their own KV, but are in
    ``uncacheable`` until freed, so no block they hold or fill later is ever hashed, since its KV rests on KV
    computed before the reset (other weights, or a cache that was freed). A request recomputed after a
    preemption starts over and caches again.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        enable_events: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found (either tier)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        if self.host_pool is not None and enable_caching:
            self.block_pool.evicted = []
        self.req_to_host_blocks: dict[str, list[KVCacheBlock]] = {}
        self.held: list[KVCacheBlock] = []  # host blocks this step copies from or to
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []
        self.host_prefix_cache_hits = 0  # tokens found in the host tier
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.uncacheable: set[str] = set()  # live at the last reset_prefix_cache: never cached again
        self.events: list[KVEvent] | None = [AllBlocksCleared()] if enable_events and enable_caching else None
        self.block_pool.events = self.events
        if self.host_pool is not None:
            self.host_pool.events = self.events
            self.host_pool.medium = HOST

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    def usage(self) -> float:
        return self.block_pool.usage()

    def host_usage(self) -> float:
        return self.host_pool.usage() if self.host_pool is not None else 0.0

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

    def get_host_hits(self, request: Request, num_device_hits: int) -> list[KVCacheBlock]:
        """Where the device chain of hits ends, its continuation in the host tier (same cap as the device's)."""
        host = self.host_pool
        if host is None or not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[num_device_hits:max_blocks]:
            block = host.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int, num_host_hit_tokens: int = 0) -> None:
        """Count an admitted request's lookup: once per admission, not per attempt, or waiting inflates the stats."""
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            self.host_prefix_cache_hits += num_host_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        host_hits: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and the cache hits).

        ``num_new_computed_tokens`` counts the device hits (``new_computed_blocks``)
        and then the host hits (``host_hits``), whose content is swapped into the
        first new blocks this step. Returns the newly allocated blocks (possibly
        none), or None — touching nothing — when the pool cannot hold them; the
        caller then preempts.
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
        if host_hits:
            # Held before the device allocation, whose evictions take host blocks from the host LRU.
            self.host_pool.touch(host_hits)
            self.held.extend(host_hits)
        new_blocks = self._get_device_blocks(num_needed)
        if host_hits:
            self._add_swap_in(host_hits, new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def _get_device_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """New device blocks; hashed blocks this evicts keep their content in the host tier when it has room."""
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        evicted = self.block_pool.evicted
        if evicted:
            self._offload(evicted)
            evicted.clear()
        return new_blocks

    def _offload(self, evicted: list[tuple[int, bytes]]) -> None:
        host = self.host_pool
        for block_id, block_hash in evicted:
            if host.get_cached_block(block_hash) is not None or not host.num_free_blocks:
                continue
            (target,) = host.get_new_blocks(1)
            self._cache_in_host(target, block_hash)
            self.held.append(target)
            self.blocks_to_swap_out.append((block_id, target.block_id))
            self.num_blocks_swapped_out += 1

    def _cache_in_host(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        # One event per hash: a host event's hashes are not a chain (they name no parent and no tokens).
        if self.host_pool.cache_block(block, block_hash) and self.events is not None:
            self.events.append(BlockStored([block_hash], None, [], HOST))

    def _add_swap_in(self, host_blocks: list[KVCacheBlock], device_blocks: list[KVCacheBlock]) -> None:
        pairs = zip(host_blocks, device_blocks)
        self.blocks_to_swap_in.extend((host.block_id, device.block_id) for host, device in pairs)
        self.num_blocks_swapped_in += len(host_blocks)

    # ---- preemption by swap ------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Move the blocks holding the request's computed tokens to the host tier and free its device blocks;
        False, changing nothing, when the host tier cannot hold them."""
        host = self.host_pool
        num_keep = -(-request.num_computed_tokens // self.block_size)
        if host is None or num_keep == 0 or num_keep > host.num_free_blocks:
            return False
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id)
        self.num_cached_blocks.pop(req_id, None)
        host_blocks = host.get_new_blocks(num_keep)
        for block, target in zip(blocks, host_blocks):
            if block.block_hash is not None and self.enable_caching:
                self._cache_in_host(target, block.block_hash)  # the copy is a host-tier cache entry too
            self.blocks_to_swap_out.append((block.block_id, target.block_id))
        self.num_blocks_swapped_out += num_keep
        self.req_to_host_blocks[req_id] = host_blocks
        self.block_pool.free_blocks(reversed(blocks))
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Give a swapped request device blocks for its computed tokens plus ``num_new_tokens`` and copy its KV
        back into them this step; False, changing nothing, when the device pool cannot hold them."""
        req_id = request.request_id
        host_blocks = self.req_to_host_blocks[req_id]
        num_needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if num_needed > self.block_pool.num_free_blocks:
            return False
        del self.req_to_host_blocks[req_id]
        self.held.extend(host_blocks)  # their references pass to the step
        blocks = self._get_device_blocks(num_needed)
        self._add_swap_in(host_blocks, blocks)
        self.req_to_blocks[req_id] = blocks
        self.num_cached_blocks[req_id] = 0  # hashed again once the step that copies them back has returned
        return True

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (device, host) swap-outs and (host, device) swap-ins; its plan is final, so the host
        blocks it copies are released (the next step's copies run after these on every rank)."""
        out, into = self.blocks_to_swap_out, self.blocks_to_swap_in
        if self.held:
            self.host_pool.free_blocks(reversed(self.held))
            self.held = []
        self.blocks_to_swap_out, self.blocks_to_swap_in = [], []
        return out, into

    def num_prefix_cached_tokens(self, request: Request) -> int:
        """Computed tokens in the request's hashed blocks: after a recompute preemption the prefix cache (device
        or host tier) gives them back without recomputing."""
        return min(self.num_cached_blocks.get(request.request_id, 0) * self.block_size, request.num_computed_tokens)

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's blocks that are now full and computed into the prefix cache."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(req_id)
        if num_cached is None or num_full <= num_cached or req_id in self.uncacheable:
            return
        fresh = self.block_pool.cache_full_blocks(
            self.req_to_blocks[req_id], request.block_hashes, num_cached, num_full
        )
        self.num_cached_blocks[req_id] = num_full
        if fresh and self.events is not None:
            self._record_stored(request, fresh)

    def _record_stored(self, request: Request, fresh: list[int]) -> None:
        """One BlockStored per run of consecutive new hashes (a hash another block already held splits a run)."""
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        start = fresh[0]
        for j, i in enumerate(fresh):
            if j + 1 < len(fresh) and fresh[j + 1] == i + 1:
                continue
            parent = hashes[start - 1] if start else None
            self.events.append(
                BlockStored(
                    hashes[start : i + 1], parent, tokens[start * size : (i + 1) * size], DEVICE, request.lora_name
                )
            )
            if j + 1 < len(fresh):
                start = fresh[j + 1]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash in both tiers, so no later lookup hits KV from before now; always True (the
        class's docstring says what becomes of the live requests)."""
        self.block_pool.forget_hashes()
        if self.host_pool is not None:
            self.host_pool.forget_hashes()
        self.uncacheable.update(self.req_to_blocks, self.req_to_host_blocks)
        for req_id in self.num_cached_blocks:  # a recompute would now get none of their tokens back
            self.num_cached_blocks[req_id] = 0
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The KV-cache events since the last call (none when events are off)."""
        if not self.events:
            return []
        taken = self.events.copy()
        self.events.clear()  # the same list: the pools append to it
        return taken

    def free(self, request: Request) -> None:
        """Release a request's blocks (device, or host when swapped), tail first, so its shared prompt head is
        evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.uncacheable.discard(request.request_id)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        host_blocks = self.req_to_host_blocks.pop(request.request_id, None)
        if host_blocks:
            self.host_pool.free_blocks(reversed(host_blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
