"""KV block allocation, reference counts, and the prefix cache.

Model: the KV pool is ``num_blocks`` blocks of ``block_size`` token slots. A request
owns an ordered list of blocks (its block table). A block is in exactly one state:

  * free      - ref_count 0, holds nothing reusable; on the free list;
  * used      - ref_count > 0: in the block table of that many requests;
  * cached    - ref_count 0 but holding a full block of a known token prefix; kept
                in LRU order and reused by a later request with the same prefix, or
                evicted (oldest first) when a fresh block is needed and none is free.

Prefix cache: a full block is identified by a chained hash (common/prefix_hash.py): the
hash of the previous block's hash and this block's token ids, so equal hashes mean
equal whole prefixes (the token ids are also compared on every hit). A block is registered
under its hash when it is scheduled to be filled, before the forward pass, so that a
request admitted later in the same step can attend to it (in-batch dedup: all KV
writes of a layer precede its reads).

Change log: with ``record_changes()``, every change to the set of hashes the cache
holds (a block registered; evicted, forgotten or reset) is noted, last one winning
per hash, until ``take_changes()``: the engine worker publishes them to its clients
(CacheEvents in common/protocol.py) so that routers know exactly what it holds.

Each query pairs a cheap check with its action: ``num_blocks_needed`` with
``can_allocate``/``allocate``; ``free`` undoes ``allocate``.

The pool is bookkept lazily: a block that was never taken has no Block object and no
free-list entry, only a place past the ones that have (``blocks`` grows on demand).
Blocks are still taken in id order, then freed ones oldest first, then evicted ones;
but start-up and host memory no longer grow with the pool: a small model on a large
GPU gets tens of millions of blocks (a 2-layer float32 test model with blocks of 4
tokens on an H200: 60 million, which took minutes and gigabytes to list).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from common.prefix_hash import chain_hash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache.
    block_hash: Optional[bytes] = None
    token_ids: Optional[tuple[int, ...]] = None


@dataclass
class BlockTable:
    """One request's view of its blocks and of its prefix hashes."""

    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the request's full blocks, computed once per block.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks already offered to the prefix cache...
    num_registered: int = 0
    # ...and, of those, to the shared KV store while the request runs
    # (kv_offload.KvOffload.running; kept when the request is preempted: its blocks,
    # computed again, have the same hashes).
    num_offered: int = 0
    # The first block's parent hash: the request's cache salt's (None: unsalted).
    root: Optional[bytes] = None
    # Leading entries let go of (the null block's id, NULL_BLOCK, in their place):
    # sliding-window layers' blocks that no query will see again (window_blocks.py).
    released: int = 0
    # The sliding-window layers' blocks, where they have a pool of their own
    # (window_blocks.WindowedBlockManager); None otherwise.
    window: Optional["BlockTable"] = None


# A cached block taken for other tokens: (block id, its hash, its token ids).
Evicted = tuple[int, bytes, tuple[int, ...]]


# The id in a table's released entries: a block of zeros no one writes (a pool made
# with null_block=True holds it taken for good), so a kernel that reads past a
# window's start reads finite keys and values it then masks out.
NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 null_block: bool = False) -> None:
        """null_block: block NULL_BLOCK is taken for good, never given out (it is not
        counted in num_blocks)."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        # Blocks taken at least once, by id; the ids from len(blocks) up are untouched,
        # and taken first, lowest first (block 0 first, for readable tests).
        self.blocks: list[Block] = []
        # Freed blocks holding nothing reusable, taken from the front once none is
        # untouched.
        self._free: OrderedDict[int, None] = OrderedDict()
        # Cached (ref 0, hashed) blocks, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        # The null block: taken at once, held for good.
        self._reserved = int(null_block)
        if null_block:
            self._num_blocks += 1
            self.blocks.append(Block(NULL_BLOCK, ref_count=1))
        # Hash -> held, since the last take_changes(); None: not recording.
        self._changes: Optional[dict[bytes, bool]] = None
        # Told of the cached blocks a call evicted, at the end of that call, before
        # anything is written into them (kv_offload.py keeps their bytes).
        self.on_evict: Optional[Callable[[list[Evicted]], None]] = None
        self._evicted: list[Evicted] = []

    # -- queries ---------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks - self._reserved

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: untouched, free and cached-evictable."""
        return self._num_blocks - len(self.blocks) + len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def longest_context(self, token_budget: int) -> int:
        """The most tokens one request can hold alone: the pool's (window_blocks.py's
        sliding pool holds more)."""
        return self.num_blocks * self.block_size

    def slide(self, table: BlockTable, num_computed: int) -> None:
        """Let go of the blocks no query from position ``num_computed`` on will see.
        With every layer attending to all keys, none (window_blocks.py overrides)."""

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds."""
        return list(self._by_hash)

    def lookup(self, block_hash: bytes) -> Optional[int]:
        """The block caching this hash, if any."""
        return self._by_hash.get(block_hash)

    def record_changes(self) -> None:
        self._changes = {}

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes the cache started holding and stopped holding since the last
        call (disjoint lists)."""
        changes, self._changes = self._changes or {}, {}
        stored = [h for h, held in changes.items() if held]
        return stored, [h for h, held in changes.items() if not held]

    def hash_blocks(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int) -> int:
        """Extend ``table.block_hashes`` over the full blocks among the first
        ``num_tokens`` tokens; returns how many full blocks that is."""
        bs = self.block_size
        num_full = num_tokens // bs
        while len(table.block_hashes) < num_full:
            i = len(table.block_hashes)
            parent = table.block_hashes[-1] if i else table.root
            table.block_hashes.append(chain_hash(parent, token_ids[i * bs:(i + 1) * bs]))
        return num_full

    def find_cached_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> list[int]:
        """Block ids caching the longest prefix of ``token_ids``; the last token is
        always left to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i in range(self.hash_blocks(table, token_ids, len(token_ids) - 1)):
            block_id = self._by_hash.get(table.block_hashes[i])
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break  # a hash collision: never reuse KV of other tokens
            hits.append(block_id)
        return hits

    def num_blocks_needed(self, table: BlockTable, num_tokens: int,
                          cached_block_ids: Sequence[int] = ()) -> int:
        """Blocks an allocation for ``num_tokens`` total tokens would take from the
        free pool, counting cached hits that are currently evictable."""
        new = self.blocks_for(num_tokens) - len(table.block_ids) - len(cached_block_ids)
        revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return max(new, 0) + revived

    def can_allocate(self, table: BlockTable, num_tokens: int,
                     cached_block_ids: Sequence[int] = ()) -> bool:
        return self.num_blocks_needed(table, num_tokens, cached_block_ids) <= self.num_free_blocks

    # -- actions ---------------------------------------------------------------

    def allocate(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int,
                 cached_block_ids: Sequence[int] = (), num_known: Optional[int] = None
                 ) -> bool:
        """Grow ``table`` to hold ``num_tokens`` tokens, first attaching
        ``cached_block_ids`` (prefix-cache hits). Registers the full blocks among the
        first ``num_tokens`` tokens in the prefix cache, or among the first
        ``num_known`` when fewer are known (the rest are placeholders: a block is
        registered once its tokens are). Returns False, changing nothing, when the
        pool cannot supply the blocks."""
        registrable = num_tokens if num_known is None else min(num_tokens, num_known)
        if (not cached_block_ids and num_tokens <= len(table.block_ids) * self.block_size
                and (not self.enable_prefix_caching
                     or registrable // self.block_size <= table.num_registered)):
            return True  # most decode steps: room in the last block, no block filled
        if not self.can_allocate(table, num_tokens, cached_block_ids):
            return False
        for block_id in cached_block_ids:
            self._ref(block_id)
            table.block_ids.append(block_id)
        while len(table.block_ids) < self.blocks_for(num_tokens):
            block_id = self._take_fresh()
            self.blocks[block_id].ref_count = 1
            table.block_ids.append(block_id)
        if self.enable_prefix_caching:
            self._register(table, token_ids, registrable)
        self._hand_over()
        return True

    def hold(self, block_ids: Sequence[int]) -> BlockTable:
        """Reference blocks already in use or cached (so that they are not evicted);
        ``free`` the returned table to let go."""
        for block_id in block_ids:
            self._ref(block_id)
        return BlockTable(block_ids=list(block_ids))

    def reserve(self, num_blocks: int) -> BlockTable:
        """Up to ``num_blocks`` fresh blocks (fewer when the pool has fewer to give),
        for KV that arrives from elsewhere; ``register`` each once filled, ``free``
        the table to let go."""
        table = BlockTable()
        for _ in range(max(0, min(num_blocks, self.num_free_blocks))):
            block_id = self._take_fresh()
            self.blocks[block_id].ref_count = 1
            table.block_ids.append(block_id)
        self._hand_over()
        return table

    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Offer a filled, held block to the prefix cache under its hash (ignored when
        the cache already holds that hash)."""
        if not self.enable_prefix_caching or block_hash in self._by_hash:
            return
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._by_hash[block_hash] = block_id
        if self._changes is not None:
            self._changes[block_hash] = True

    def free(self, table: BlockTable) -> None:
        """Release the request's blocks. Hashed blocks stay cached; the tail is
        released first so that it is evicted before the shared head."""
        for block_id in reversed(table.block_ids[table.released:]):
            self._unref(block_id)
        table.block_ids.clear()
        table.num_registered = table.released = 0

    def release(self, table: BlockTable, num_blocks: int) -> None:
        """Let go of the table's first ``num_blocks`` blocks, oldest first (hashed ones
        stay cached); NULL_BLOCK takes their places."""
        num_blocks = min(num_blocks, len(table.block_ids))
        for i in range(table.released, num_blocks):
            self._unref(table.block_ids[i])
            table.block_ids[i] = NULL_BLOCK
        table.released = max(table.released, num_blocks)
        # a block let go of unregistered (a placeholder's) is not offered later
        table.num_registered = max(table.num_registered, table.released)

    def forget_from(self, table: BlockTable, num_tokens: int) -> list[int]:
        """Take the blocks of ``table`` holding tokens at or after ``num_tokens`` out of
        the prefix cache: a step that was filling them failed, so their KV may be
        garbage. Returns their ids (another request of the same step may have
        attached them)."""
        first = max(num_tokens // self.block_size, table.released)
        block_ids = table.block_ids[first:]
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and self._by_hash.get(block.block_hash) == block_id:
                self._unhash(block.block_hash)
            block.block_hash = None
            block.token_ids = None
        table.num_registered = min(table.num_registered, first)
        table.num_offered = min(table.num_offered, first)
        return block_ids

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a failed step, whose KV may be garbage)."""
        for block_id in list(self._evictable):
            del self._evictable[block_id]
            self._free[block_id] = None
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        for block_hash in list(self._by_hash):
            self._unhash(block_hash)

    # -- internals -------------------------------------------------------------

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free[block_id] = None

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        if len(self.blocks) < self._num_blocks:
            self.blocks.append(Block(len(self.blocks)))
            return len(self.blocks) - 1
        if self._free:
            block_id, _ = self._free.popitem(last=False)
            return block_id
        block_id, _ = self._evictable.popitem(last=False)  # least recently used
        block = self.blocks[block_id]
        assert block.block_hash is not None and block.token_ids is not None
        if self.on_evict is not None:
            self._evicted.append((block_id, block.block_hash, block.token_ids))
        if self._by_hash.get(block.block_hash) == block_id:
            self._unhash(block.block_hash)
        block.block_hash = None
        block.token_ids = None
        return block_id

    def _hand_over(self) -> None:
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            assert self.on_evict is not None
            self.on_evict(evicted)

    def _unhash(self, block_hash: bytes) -> None:
        del self._by_hash[block_hash]
        if self._changes is not None:
            self._changes[block_hash] = False

    def _register(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int) -> None:
        bs = self.block_size
        num_full = self.hash_blocks(table, token_ids, num_tokens)
        for i in range(table.num_registered, num_full):
            block_hash = table.block_hashes[i]
            block = self.blocks[table.block_ids[i]]
            if block.block_hash is not None:
                continue  # already registered (a hit, or an earlier step)
            # The same prefix cached in another block: register keeps that one.
            self.register(block.block_id, block_hash, token_ids[i * bs:(i + 1) * bs])
        table.num_registered = max(table.num_registered, num_full)
