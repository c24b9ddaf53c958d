"""Physical KV-cache blocks: ref counts, the LRU free queue, and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.block_hash import BlockHash
from scheduler.kv_events import DEVICE, BlockRemoved, KVEvent


class KVCacheBlock:
    """One physical block. ``prev_free``/``next_free`` thread it into the free queue.

    ``block_hash`` is set only while the block holds a full block of exactly the
    tokens the hash names; a hashed block with ``ref_cnt == 0`` is still a
    cache entry until it is evicted from the free queue's head.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    Sentinel head and tail nodes remove every edge case, so popleft, append and
    remove (a cache hit taking a block out of the middle) are all O(1) with no
    allocation. The head holds the least recently freed block, evicted first.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks left to pop")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        node = self.head.next_free
        while node is not self.tail:
            yield node
            node = node.next_free


class BlockPool:
    """All physical blocks of one KV cache.

    Invariants (checked by the property tests):
    - block 0 is the null block: never in the free queue, never handed out;
    - for every other block, ``ref_cnt == 0`` ⇔ it is in the free queue;
    - a block is in ``cached_blocks`` under h ⇔ its ``block_hash`` is h;
    - ``num_free_blocks + blocks with ref_cnt > 0 == num_blocks - 1``.

    The host tier (KVCacheManager.host_pool) is a second BlockPool with the
    same rules over host-memory blocks (its block 0 is unused too, so that
    both tiers share this code). With ``evicted`` set to a list, every
    eviction appends ``(block_id, block_hash)`` to it, so the caller can keep
    the content in the next tier before the block is overwritten.

    With ``events`` set to a list (KV-cache events, scheduler/kv_events.py),
    a hash whose last block is evicted appends a BlockRemoved naming
    ``medium``; the caller records the hashes ``cache_full_blocks`` reports
    new (it knows their tokens). Replaying them gives ``cached_blocks``' keys.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is invalid: need the null block plus at least one")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # Several blocks may hold the same content (computed concurrently before
        # either was cached), so each hash maps to its blocks by id.
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.evicted: list[tuple[int, BlockHash]] | None = None
        self.events: list[KVEvent] | None = None
        self.medium = DEVICE

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable blocks referenced by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.free_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self.cached_blocks.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.free_queue.num_free_blocks} are free")
        out = []
        popleft = self.free_queue.popleft
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if self.evicted is not None:
            self.evicted.append((block.block_id, block.block_hash))
        same = self.cached_blocks[block.block_hash]
        del same[block.block_id]
        if not same:
            del self.cached_blocks[block.block_hash]
            if self.events is not None:
                self._record_removed(block.block_hash)
        block.block_hash = None

    def _record_removed(self, block_hash: BlockHash) -> None:
        events = self.events
        last = events[-1] if events else None
        # Consecutive removals share one event: fewer bytes, the same order.
        if type(last) is BlockRemoved and last.medium == self.medium:
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash], self.medium))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order."""
        append = self.free_queue.append
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block is not self.null_block:
                append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], num_cached: int, num_full: int
    ) -> list[int]:
        """Enter blocks[num_cached:num_full] into the prefix cache under their hashes; returns the indices whose
        hash is new to the cache (no other block held it), in order."""
        cached = self.cached_blocks
        fresh = []
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is not None:  # a shared hit, already cached
                continue
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            same = cached.get(block_hash)
            if same is None:
                cached[block_hash] = {block.block_id: block}
                fresh.append(i)
            else:
                same[block.block_id] = block
        return fresh

    def forget_hashes(self) -> None:
        """Empty the prefix cache: every block keeps its references and content but no hash, so no lookup finds it
        (the weights changed, or the KV tensors were freed). No BlockRemoved: the caller records one
        AllBlocksCleared for both tiers."""
        for same in self.cached_blocks.values():
            for block in same.values():
                block.block_hash = None
        self.cached_blocks.clear()

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Enter one block, known to hold exactly the tokens ``block_hash`` names, into the cache; True when the
        hash is new to it."""
        return bool(self.cache_full_blocks([block], [block_hash], 0, 1))
