"""Sliding-window layers' KV blocks in a pool of their own, let go of as the window
passes them.

Model. In a model whose layers mix full attention with a sliding window (Gemma 2 and
3, gpt-oss, Qwen2 with use_sliding_window), a query at position p of a sliding layer
sees only keys p - W + 1 .. p. Kept in one pool, every layer holds a request's whole
context; here the sliding layers' caches have blocks of their own, in a second pool
(``local``), and a request's second block table (``BlockTable.window``, indexed as the
first) lets go of each block once no query to come sees it: its entry becomes
NULL_BLOCK, a block of zeros no one writes. So a sliding layer holds about W tokens a
request, whatever the context, and the full layers' pool takes the memory saved.

The local pool is sized (``local_pool_blocks``) so that every request that may run at
once holds its window and a step's chunks: it never runs short before the full pool
does. Should it, ``allocate`` refuses as the full pool does, and the scheduler
preempts.

The prefix cache covers both pools with the same chained hashes: a block let go of
while hashed stays cached in its pool, as a finished request's do. A prefix of n
blocks is a hit when the full layers' pool holds all n and the local pool holds the
ones a query at its end still sees (the last W keys); else the longest shorter prefix
that is. Routers hear of the full layers' blocks (``take_changes``).

Block ids of the two pools are separate spaces; step_inputs.py gives each its table
and its cache slots, and each layer takes its group's (AttentionMetadata.local).

Where every layer slides (Mistral 7B v0.1, Phi-3-mini-4k), the one pool's tables let
go of blocks the same way (SlidingBlockManager): a request holds a window and a step's
tokens, so a pool that holds that much serves the model's whole context.

Disaggregated engines let go of nothing (kv_transfer.py moves whole tables).
"""

from __future__ import annotations

from typing import Optional, Sequence

from engine_worker.block_manager import NULL_BLOCK, BlockManager, BlockTable


def local_pool_blocks(window: int, block_size: int, max_running: int, token_budget: int
                      ) -> int:
    """Blocks the sliding layers' pool needs so that it never runs short: each of
    ``max_running`` requests holds the blocks its window's keys and its step's n
    tokens span, at most ceil((W - 1) / bs) + 1 + ceil(n / bs), under
    ceil((W - 1) / bs) + 2 + n / bs; a step's n add up to its token budget at most."""
    per_request = -(-(window - 1) // block_size) + 2
    return max_running * per_request + -(-token_budget // block_size)


def split_pool(budget_bytes: int, layer_block_bytes: int, num_full_layers: int,
               num_local_layers: int, local_needed: int) -> tuple[int, int]:
    """A KV memory budget in blocks: (the full layers' pool's, the sliding layers' pool's
    with its null block). The local pool gets what it needs (``local_needed``: 0 for
    no pool of its own), the full one the rest; where that would leave the full pool
    fewer blocks than the local one, both get as many."""
    layers = num_full_layers + num_local_layers
    if not local_needed:
        return budget_bytes // (layers * layer_block_bytes), 0
    same = max(0, budget_bytes - num_local_layers * layer_block_bytes) // (
        layers * layer_block_bytes)
    if local_needed >= same:
        return same, same + 1
    left = budget_bytes - (local_needed + 1) * num_local_layers * layer_block_bytes
    return left // (num_full_layers * layer_block_bytes), local_needed + 1


def first_seen(position: int, window: int, block_size: int) -> int:
    """The first block holding a key a query at ``position`` sees."""
    return max(0, position - window + 1) // block_size


def window_hits(pool: BlockManager, table: BlockTable, token_ids: Sequence[int],
                num_blocks: int, window: int) -> Optional[list[int]]:
    """The blocks of ``pool`` caching the keys a query after a prefix of ``num_blocks``
    blocks (hashed in ``table``) sees, from its window's first block on; None when
    one is missing (tokens verified, as BlockManager.find_cached_prefix does)."""
    bs = pool.block_size
    hits = []
    for i in range(first_seen(num_blocks * bs, window, bs), num_blocks):
        block_id = pool.lookup(table.block_hashes[i])
        if (block_id is None
                or pool.blocks[block_id].token_ids != tuple(token_ids[i * bs:(i + 1) * bs])):
            return None
        hits.append(block_id)
    return hits


def _skip(table: BlockTable, num_blocks: int) -> None:
    """A fresh table's first blocks, which no query will see: released from the
    start."""
    assert not table.block_ids, "prefix hits attach to a request holding no blocks"
    table.block_ids.extend([NULL_BLOCK] * num_blocks)
    table.released = table.num_registered = num_blocks


def _unskip(table: BlockTable) -> None:
    table.block_ids.clear()
    table.released = table.num_registered = 0


class SlidingBlockManager(BlockManager):
    """Every layer slides (Mistral 7B v0.1, Phi-3-mini-4k): one pool, with the null
    block, whose tables let go of blocks as the window passes. A prefix hit is the
    longest prefix whose last window is cached; ``find_cached_prefix`` gives
    NULL_BLOCK for the blocks before it."""

    def __init__(self, num_blocks: int, block_size: int, window: int,
                 enable_prefix_caching: bool) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, null_block=True)
        self.window = window

    def find_cached_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        for n in range(self.hash_blocks(table, token_ids, len(token_ids) - 1), 0, -1):
            hits = window_hits(self, table, token_ids, n, self.window)
            if hits is not None:
                return [NULL_BLOCK] * (n - len(hits)) + hits
        return []

    def longest_context(self, token_budget: int) -> int:
        """Any length, once the pool holds a window and a step's tokens."""
        if self.num_blocks >= local_pool_blocks(self.window, self.block_size, 1,
                                                token_budget):
            return 1 << 62
        return super().longest_context(token_budget)

    def slide(self, table: BlockTable, num_computed: int) -> None:
        self.release(table, first_seen(num_computed, self.window, self.block_size))

    def allocate(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int,
                 cached_block_ids: Sequence[int] = (), num_known: Optional[int] = None
                 ) -> bool:
        skipped = sum(1 for b in cached_block_ids if b == NULL_BLOCK)
        if skipped:
            _skip(table, skipped)
        if super().allocate(table, token_ids, num_tokens, cached_block_ids[skipped:],
                            num_known):
            return True
        if skipped:
            _unskip(table)
        return False


class WindowedBlockManager(BlockManager):
    """The full-attention layers' pool (this manager's own, as BlockManager's) and the
    sliding layers' (``local``, of ``num_local_blocks``, the null block among them),
    both grown and freed through the full table (its ``window`` holds the local one)."""

    def __init__(self, num_blocks: int, num_local_blocks: int, block_size: int,
                 window: int, enable_prefix_caching: bool) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if window < 1 or num_local_blocks < 2:
            raise ValueError(f"a window pool needs a window and blocks, got {window} and "
                             f"{num_local_blocks}")
        self.window = window
        self.local = BlockManager(num_local_blocks - 1, block_size, enable_prefix_caching,
                                  null_block=True)

    def _local_table(self, table: BlockTable) -> BlockTable:
        if table.window is None:  # the hashes are the same list: computed once
            table.window = BlockTable(block_hashes=table.block_hashes, root=table.root)
        return table.window

    def find_cached_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> list[int]:
        hits = super().find_cached_prefix(table, token_ids)
        n = len(hits)
        while n and window_hits(self.local, table, token_ids, n, self.window) is None:
            n -= 1
        return hits[:n]

    def slide(self, table: BlockTable, num_computed: int) -> None:
        if table.window is not None:
            self.local.release(table.window,
                               first_seen(num_computed, self.window, self.block_size))

    def allocate(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int,
                 cached_block_ids: Sequence[int] = (), num_known: Optional[int] = None
                 ) -> bool:
        local = self._local_table(table)
        hits: list[int] = []
        if cached_block_ids:
            found = window_hits(self.local, table, token_ids, len(cached_block_ids),
                                self.window)
            assert found is not None, "hits that find_cached_prefix did not give"
            hits = found
            _skip(local, len(cached_block_ids) - len(hits))  # keys no query will see
        if not (self.local.can_allocate(local, num_tokens, hits)
                and super().allocate(table, token_ids, num_tokens, cached_block_ids,
                                     num_known)):
            if cached_block_ids:
                _unskip(local)
            return False
        done = self.local.allocate(local, token_ids, num_tokens, hits, num_known)
        assert done, "the local pool could give the blocks a moment ago"
        return True

    def free(self, table: BlockTable) -> None:
        super().free(table)
        if table.window is not None:
            self.local.free(table.window)

    def forget_from(self, table: BlockTable, num_tokens: int) -> list[int]:
        if table.window is not None:
            self.local.forget_from(table.window, num_tokens)
        return super().forget_from(table, num_tokens)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.local.reset_prefix_cache()
