"""Block allocation, exact reference counts, the prefix cache and LRU eviction."""

from __future__ import annotations

from common.prefix_hash import chain_hash
from engine_worker.block_manager import BlockManager, BlockTable


def refs(bm: BlockManager) -> list[int]:
    """Every block's reference count (a block never taken has no Block yet)."""
    return [b.ref_count for b in bm.blocks] + [0] * (bm.num_blocks - len(bm.blocks))


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    table = BlockTable()
    tokens = list(range(10))
    assert bm.allocate(table, tokens, 10)
    assert table.block_ids == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0, 0, 0]
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.num_cached_blocks) == (3, 3, 0)
    # Two full blocks (tokens 0-7) are registered; the partial third is not.
    assert bm.blocks[0].block_hash == chain_hash(None, [0, 1, 2, 3])
    assert bm.blocks[1].block_hash == chain_hash(bm.blocks[0].block_hash, [4, 5, 6, 7])
    assert bm.blocks[2].block_hash is None

    # Growing by one token stays inside block 2; reaching 13 tokens takes block 3.
    tokens += [10, 11, 12]
    assert bm.allocate(table, tokens, 11)
    assert table.block_ids == [0, 1, 2]
    assert bm.allocate(table, tokens, 13)
    assert table.block_ids == [0, 1, 2, 3]
    assert bm.blocks[2].block_hash is not None  # now full

    bm.free(table)
    assert table.block_ids == []
    assert refs(bm) == [0] * 6
    # Hashed blocks stay cached; the partial block 3 goes back to the free list.
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.num_cached_blocks) == (6, 0, 3)


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = BlockTable(), BlockTable()
    prompt_a = list(range(100, 110))
    assert bm.allocate(a, prompt_a, 10)
    prompt_b = prompt_a[:8] + [7, 7, 7]
    hits = bm.find_cached_prefix(b, prompt_b)
    assert hits == [0, 1]
    assert bm.num_blocks_needed(b, 11, hits) == 1  # hits are in use: only the tail is new
    assert bm.allocate(b, prompt_b, 11, hits)
    assert b.block_ids == [0, 1, 3]
    assert refs(bm)[:4] == [2, 2, 1, 1]
    bm.free(a)
    assert refs(bm)[:4] == [1, 1, 0, 1]
    assert bm.num_cached_blocks == 0  # blocks 0, 1 still used by b; block 2 unhashed
    bm.free(b)
    assert refs(bm) == [0] * 8
    assert bm.num_cached_blocks == 2


def test_hit_revives_cached_block_and_costs_a_free_block():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = BlockTable()
    prompt = list(range(9))
    assert bm.allocate(a, prompt, 9)  # blocks 0, 1 full and hashed, 2 partial
    bm.free(a)
    b = BlockTable()
    hits = bm.find_cached_prefix(b, prompt)
    assert hits == [0, 1]
    # Reviving the two cached blocks takes them out of the evictable pool.
    assert bm.num_blocks_needed(b, 9, hits) == 3
    assert bm.allocate(b, prompt, 9, hits)
    assert bm.num_cached_blocks == 0
    assert refs(bm) == [1, 1, 0, 1]  # the freed partial block 2 went to the back of the free list


def test_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = BlockTable()
    prompt = list(range(8))  # exactly two full blocks
    assert bm.allocate(a, prompt, 8)
    # The same prompt again: its last token must be computed for its logits, so only
    # the first block (tokens 0-3) can be reused.
    assert bm.find_cached_prefix(BlockTable(), prompt) == [0]


def test_lru_eviction_takes_free_blocks_first_then_oldest_cached():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first, second = BlockTable(), BlockTable()
    assert bm.allocate(first, [1, 2, 3, 4], 4)  # blocks 0, 1
    assert bm.allocate(second, [5, 6], 2)  # block 2
    bm.free(first)  # released tail first: LRU order 1, 0
    bm.free(second)  # then 2
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 4
    third = BlockTable()
    assert bm.allocate(third, [9, 9, 9, 9], 4)
    # Block 3 was never used (free list) and goes first; then the oldest cached: 1.
    assert third.block_ids == [3, 1]
    assert bm.find_cached_prefix(BlockTable(), [1, 2, 3, 4, 0]) == [0]  # 1 was evicted
    assert bm.find_cached_prefix(BlockTable(), [5, 6, 0]) == [2]


def test_cannot_allocate_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    table = BlockTable()
    assert not bm.can_allocate(table, 9)
    assert not bm.allocate(table, list(range(9)), 9)
    assert table.block_ids == [] and refs(bm) == [0, 0]
    assert bm.num_free_blocks == 2


def test_hit_verifies_token_ids():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = BlockTable()
    assert bm.allocate(a, [1, 2, 3], 3)
    bm.blocks[0].token_ids = (1, 99)  # as if another prefix had collided on the hash
    assert bm.find_cached_prefix(BlockTable(), [1, 2, 3]) == []


def test_prefix_caching_off_registers_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = BlockTable()
    assert bm.allocate(a, [1, 2, 3, 4], 4)
    assert all(b.block_hash is None for b in bm.blocks)
    bm.free(a)
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(BlockTable(), [1, 2, 3, 4, 5]) == []


def test_reset_prefix_cache_frees_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = BlockTable()
    assert bm.allocate(a, [1, 2, 3, 4], 4)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    assert bm.find_cached_prefix(BlockTable(), [1, 2, 3, 4, 5]) == []


def test_chain_hash_depends_on_the_whole_prefix():
    h1 = chain_hash(None, [1, 2])
    assert chain_hash(h1, [3, 4]) != chain_hash(chain_hash(None, [9, 9]), [3, 4])
    assert chain_hash(None, [1, 2]) == h1  # deterministic across calls (and processes)


def test_a_pool_of_a_billion_blocks_costs_only_the_blocks_taken():
    """A small model on a large GPU: tens of millions of blocks (60 million for the
    2-layer test model on an H200). Building the pool lists none of them."""
    bm = BlockManager(num_blocks=10**9, block_size=4, enable_prefix_caching=True)
    first, second = BlockTable(), BlockTable()
    assert bm.allocate(first, list(range(10)), 10)
    assert bm.allocate(second, list(range(100, 106)), 6)
    assert (first.block_ids, second.block_ids) == ([0, 1, 2], [3, 4])
    assert (bm.num_free_blocks, bm.num_used_blocks) == (10**9 - 5, 5)
    bm.free(first)  # blocks 0 and 1 cached, block 2 free
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (10**9 - 2, 2)
    # Untouched blocks go first, then freed ones (oldest first), then cached ones.
    third = BlockTable()
    assert bm.allocate(third, list(range(200, 204)), 4)
    assert third.block_ids == [5]
    assert len(bm.blocks) == 6
