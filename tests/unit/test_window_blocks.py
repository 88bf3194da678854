"""Sliding-window layers' blocks in a pool of their own (engine_worker/window_blocks.py):
let go of as the window passes, cached under the full layers' hashes, sized so that
it never runs short first; and an engine over a model of both kinds of layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import InvalidRequestError
from common.protocol import KvSource, SamplingParams
from engine_worker.block_manager import NULL_BLOCK, BlockManager, BlockTable
from engine_worker.request import Request
from engine_worker.scheduler import ScheduledRequest
from engine_worker.step_inputs import StepInputs
from engine_worker.window_blocks import (SlidingBlockManager, WindowedBlockManager,
                                        local_pool_blocks, split_pool)
from frontend.metrics import _engine_families
from frontend.serving import EngineSnapshot, PipelineSnapshot
from helpers import greedy, make_engine, random_prompts, run_to_end


def refs(bm: BlockManager) -> list[int]:
    """Every block's reference count (a block never taken has no Block yet)."""
    return [b.ref_count for b in bm.blocks] + [0] * (bm._num_blocks - len(bm.blocks))


def manager(num_local_blocks: int = 11, window: int = 6) -> WindowedBlockManager:
    return WindowedBlockManager(num_blocks=16, num_local_blocks=num_local_blocks,
                                block_size=4, window=window, enable_prefix_caching=True)


def live(table: BlockTable) -> list[int]:
    return table.block_ids[table.released:]


def test_the_local_pool_holds_each_requests_window_and_a_steps_chunks():
    # a window of 9 keys over blocks of 4 spans at most ceil(8 / 4) + 1 blocks, and
    # one more for a token that starts a block; 8 tokens of chunks take 2 more
    assert local_pool_blocks(9, 4, 2, 8) == 2 * 4 + 2
    assert local_pool_blocks(4096, 16, 256, 8192) == 256 * 258 + 512
    # 1 full layer, 5 sliding, 1000-byte blocks: the local pool gets 10 (+ the null
    # block), the full one the rest
    assert split_pool(100_000, 1000, 1, 5, 10) == (100 - 11 * 5, 11)
    # a need as large as an even split's: both pools alike
    assert split_pool(100_000, 1000, 1, 5, 16) == (15, 16)
    assert split_pool(100_000, 1000, 1, 5, 0) == (16, 0)  # one pool


def test_blocks_behind_the_window_are_let_go_of_and_stay_cached():
    bm = manager()
    table = BlockTable()
    tokens = list(range(100, 120))
    assert bm.allocate(table, tokens, 8)  # the prompt: both pools, 2 blocks each
    assert table.block_ids == [0, 1] and table.window.block_ids == [1, 2]  # 0: null
    bm.slide(table, 8)  # a query at 8 sees keys 3..8: block 0 still
    assert bm.allocate(table, tokens, 9)
    assert live(table.window) == [1, 2, 3]
    bm.slide(table, 12)  # keys 7..12: block 0 (keys 0-3) is behind every query to come
    assert bm.allocate(table, tokens, 13)
    assert table.window.block_ids == [NULL_BLOCK, 2, 3, 4] and table.window.released == 1
    assert table.block_ids == [0, 1, 2, 3]  # the full layers keep everything
    # the block let go of is cached (its hash is the full pool's block 0's)
    assert refs(bm.local)[:5] == [1, 0, 1, 1, 1]  # the null block is held for good
    assert bm.local.lookup(bm.blocks[0].block_hash) == 1
    assert (bm.local.num_cached_blocks, bm.local.num_free_blocks) == (1, 10 - 3)
    bm.free(table)
    assert refs(bm.local) == [1] + [0] * 10 and refs(bm) == [0] * 16
    assert table.window.block_ids == [] and table.window.released == 0


def test_a_prefix_hit_needs_the_window_the_query_after_it_sees():
    bm = manager(num_local_blocks=6)  # 5 blocks besides the null one
    a = BlockTable()
    prompt = list(range(200, 217))  # 4 full blocks and a token
    assert bm.allocate(a, prompt, 17)
    bm.free(a)
    assert bm.local.num_cached_blocks == 4

    b = BlockTable()
    hits = bm.find_cached_prefix(b, prompt[:16] + [5, 6])
    assert hits == [0, 1, 2, 3]
    # a query at 16 sees keys 11..16: blocks 2 and 3 of the sliding layers; 0 and 1
    # are not attached
    assert bm.allocate(b, prompt[:16] + [5, 6], 18, hits)
    assert b.window.block_ids[:2] == [NULL_BLOCK, NULL_BLOCK] and b.window.released == 2
    assert b.window.block_ids[2:4] == [bm.local.lookup(b.block_hashes[i]) for i in (2, 3)]
    assert refs(bm.local)[1:] == [0, 0, 1, 1, 1]  # blocks 0 and 1's stay cached, unheld
    bm.free(b)


def test_a_prefix_hit_is_as_long_as_the_local_pool_holds_its_window():
    bm = manager(num_local_blocks=6)
    a = BlockTable()
    prompt = list(range(200, 217))
    assert bm.allocate(a, prompt, 17)
    bm.free(a)
    # Another request takes two local blocks: the free one (the partial block's),
    # then the least recently used cached one (block 3's: a table is freed tail first)
    c = BlockTable()
    assert bm.allocate(c, [9] * 8, 8)
    hashes = a.block_hashes
    assert bm.local.lookup(hashes[3]) is None and bm.lookup(hashes[3]) is not None
    bm.free(c)
    # so the longest prefix with its window is 3 blocks (a query at 12 sees 1 and 2)
    b = BlockTable()
    hits = bm.find_cached_prefix(b, prompt[:16] + [5, 6])
    assert hits == [0, 1, 2]
    assert bm.allocate(b, prompt[:16] + [5, 6], 18, hits)
    assert b.window.block_ids[:3] == [NULL_BLOCK] + [bm.local.lookup(hashes[i]) for i in (1, 2)]


def test_a_local_pool_too_short_refuses_and_changes_nothing():
    bm = manager(num_local_blocks=3, window=100)  # 2 blocks; nothing slides
    table = BlockTable()
    assert not bm.allocate(table, list(range(12)), 12)
    assert table.block_ids == [] and table.window.block_ids == []
    assert refs(bm) == [0] * 16 and bm.local.num_free_blocks == 2
    assert bm.allocate(table, list(range(8)), 8)


def test_an_engine_holds_a_window_of_its_sliding_layers_blocks(tiny_gemma3_dir):
    # tiny Gemma 3: 2 sliding layers (a window of 9) and a full one, blocks of 4
    engine = make_engine(tiny_gemma3_dir)
    bm = engine.block_manager
    assert isinstance(bm, WindowedBlockManager)
    assert [c.shape[1] for c in engine.runner.kv_caches] == [bm.local.num_blocks + 1] * 2 + [
        bm.num_blocks]
    prompt = random_prompts([60])[0]
    engine.add_request("r", prompt, greedy(10))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        r = engine.requests.get("r")
        if r is not None:
            held.append((len(live(r.blocks)), len(live(r.blocks.window))))
    # The prompt's step holds all 15 blocks. A decode step at position c holds the
    # blocks from c - 8's (the window's first key) to c's: always 3 with blocks of 4;
    # the full layers hold everything. (The tenth token's step ends the request.)
    assert held == [(15, 15)] + [(16, 3)] * 4 + [(17, 3)] * 4


def test_engines_with_and_without_the_local_pool_give_the_same_tokens(tiny_gpt_oss_dir):
    prompts = random_prompts([3, 30, 45])
    windowed = make_engine(tiny_gpt_oss_dir, num_blocks=40)
    assert isinstance(windowed.block_manager, WindowedBlockManager)
    one_pool = make_engine(tiny_gpt_oss_dir, num_blocks=40, window_pool=False)
    assert not isinstance(one_pool.block_manager, WindowedBlockManager)
    assert (windowed.generate(prompts, greedy(24)) == one_pool.generate(prompts, greedy(24)))


def test_step_inputs_give_the_sliding_layers_their_table_and_slots():
    inputs = StepInputs(max_tokens=8, max_seqs=2, max_blocks_per_seq=4, block_size=2,
                        device=torch.device("cpu"), windowed=True)
    r = Request("r", list(range(4)), SamplingParams(max_tokens=4), 4, frozenset())
    r.blocks = BlockTable(block_ids=[5, 6], window=BlockTable(block_ids=[3, 1]))
    r.num_computed_tokens = 3  # position 3: the second block, offset 1
    batch = inputs.prepare([ScheduledRequest(r, 1)], [0], 1)
    assert batch.meta.slot_mapping.tolist() == [6 * 2 + 1]
    assert batch.meta.local.slot_mapping.tolist() == [1 * 2 + 1]
    assert batch.meta.local.block_tables[0, :2].tolist() == [3, 1]
    assert batch.meta.block_tables[0, :2].tolist() == [5, 6]
    # Position 4 takes a third block; the first is let go of: its entry reads the
    # null block from now on (a kernel may read a window's first block whole)
    r.token_ids.append(9)
    r.num_computed_tokens = 4
    r.blocks.block_ids.append(8)
    r.blocks.window.block_ids[:] = [NULL_BLOCK, 1, 4]
    r.blocks.window.released = 1
    batch = inputs.prepare([ScheduledRequest(r, 1)], [0], 1)
    assert batch.meta.local.block_tables[0, :3].tolist() == [NULL_BLOCK, 1, 4]
    assert batch.meta.local.slot_mapping.tolist() == [4 * 2]
    assert batch.meta.block_tables[0, :3].tolist() == [5, 6, 8]


def test_an_engine_of_two_pools_lends_no_kv_and_computes_what_it_would_pull(tiny_gemma3_dir):
    """A KV transfer moves whole block tables: an engine of two pools refuses to hold a
    prompt's blocks for another engine, and computes a prompt it is told to pull."""
    engine = make_engine(tiny_gemma3_dir)
    prompt = random_prompts([30])[0]
    with pytest.raises(InvalidRequestError, match="cannot lend a prompt's KV"):
        engine.add_request("lease", prompt, greedy(4), kv_lease_s=5.0)
    assert "lease" not in engine.requests
    engine.add_request("pulled", prompt, greedy(4),
                       kv_source=KvSource(address="tcp://127.0.0.1:1", request_id="x"))
    assert engine.kv.receiver.stats.num_transfers == 0
    outputs = run_to_end(engine)["pulled"]
    assert [t for out in outputs for t in out.new_token_ids] == engine.generate(
        [prompt], greedy(4))[0]


def test_where_every_layer_slides_one_pool_lets_blocks_go():
    bm = SlidingBlockManager(num_blocks=8, block_size=4, window=6, enable_prefix_caching=True)
    assert bm.num_blocks == 8 and refs(bm)[0] == 1  # the null block, held for good
    a = BlockTable()
    prompt = list(range(300, 317))  # 4 full blocks and a token
    assert bm.allocate(a, prompt, 17)
    assert a.block_ids == [1, 2, 3, 4, 5]
    bm.slide(a, 17)  # keys 12..17: blocks 0-2 are behind every query to come
    assert a.block_ids == [NULL_BLOCK] * 3 + [4, 5] and a.released == 3
    assert bm.num_free_blocks == 8 - 2 and bm.num_cached_blocks == 3
    bm.free(a)
    # a hit: the prefix's last window cached; the blocks before it are not attached
    b = BlockTable()
    hits = bm.find_cached_prefix(b, prompt[:16] + [7])
    assert hits == [NULL_BLOCK, NULL_BLOCK, 3, 4]
    assert bm.allocate(b, prompt[:16] + [7], 17, hits)
    assert b.block_ids[:4] == [NULL_BLOCK, NULL_BLOCK, 3, 4] and b.released == 2
    assert refs(bm)[1:7] == [0, 0, 1, 1, 0, 1]  # and an untouched block for its tail
    bm.free(b)
    assert refs(bm) == [1] + [0] * 8
    # a pool that cannot give the blocks refuses and keeps the table empty
    c = BlockTable()
    hits = bm.find_cached_prefix(c, prompt[:16] + list(range(30)))
    assert not bm.allocate(c, prompt[:16] + list(range(30)), 46, hits)
    assert c.block_ids == [] and c.released == 0


def test_where_every_layer_slides_a_context_needs_only_a_window_of_the_pool(tiny_sliding_dir):
    # Mistral's window of 16 keys, blocks of 4: a request holds at most 4 + 2 blocks
    # and a step's chunk (8 tokens: 2), so 16 blocks hold a context of any length
    engine = make_engine(tiny_sliding_dir, num_blocks=16, budget=8)
    assert isinstance(engine.block_manager, SlidingBlockManager)
    assert engine.max_model_len == engine.model_config.max_model_len > 16 * 4
    prompt = random_prompts([100])[0]
    want = make_engine(tiny_sliding_dir, num_blocks=64, window_pool=False).generate(
        [prompt], greedy(20))
    assert engine.generate([prompt], greedy(20)) == want
    assert engine.stats().num_preemptions == 0
    # with a step of 512 tokens one request may need 130 blocks: the context stays
    # within the pool
    assert make_engine(tiny_sliding_dir, num_blocks=16).max_model_len == 16 * 4


def test_the_sliding_layers_pool_is_in_the_stats_and_the_metrics(tiny_gemma3_dir):
    engine = make_engine(tiny_gemma3_dir)
    engine.add_request("r", random_prompts([60])[0], greedy(3))
    engine.step()  # the prompt: 15 blocks in each pool
    engine.step()  # a decode step: 3 of them in the local one
    stats = engine.stats()
    local = engine.block_manager.local
    assert (stats.num_blocks_used, stats.num_window_blocks_used) == (16, 3)
    assert stats.num_window_blocks_total == local.num_blocks
    assert stats.num_window_blocks_cached == 13  # let go of, hashed
    snap = PipelineSnapshot(engines=[EngineSnapshot(
        address="tcp://e:1", role="mixed", healthy=True, draining=False, load=1,
        num_routed=1, num_prefix_routed=0, num_blocks_known=0, num_cache_resyncs=0,
        stats=stats)], num_jobs=1, admitted_requests=0, admitted_tokens=0,
        tokenizer_queue=0, num_retries=0, num_failovers=0)
    families = {f.name: f for f in _engine_families(snap, "m", lambda address: "0")}
    window = {s.labels["state"]: s.value
              for s in families["roseserve_engine_window_kv_blocks"].samples}
    assert window == {"used": 3, "cached": 13, "free": local.num_blocks - 3}
    usage = families["vllm:kv_cache_usage_perc"].samples[0].value
    assert usage == max(16 / 512, 3 / local.num_blocks)
    # an engine of one pool has no such samples
    one = make_engine(tiny_gemma3_dir, window_pool=False).stats()
    assert one.num_window_blocks_total == 0
    snap.engines[0] = dataclasses.replace(snap.engines[0], stats=one)
    families = {f.name: f for f in _engine_families(snap, "m", lambda address: "0")}
    assert families["roseserve_engine_window_kv_blocks"].samples == []


def test_disaggregated_engines_let_go_of_nothing():
    """`python -m engine_worker --role prefill|decode` keeps every layer's blocks (a KV
    transfer moves whole tables); a mixed engine, and `roseserve serve`'s own check of
    the flags (no --role), let them go."""
    from engine_worker.__main__ import build_parser, engine_config_from_args

    def window_pool(*argv: str) -> bool:
        return engine_config_from_args(build_parser().parse_args(list(argv))).cache.window_pool

    assert window_pool() and window_pool("--role", "mixed")
    assert not window_pool("--role", "prefill") and not window_pool("--role", "decode")
    args = build_parser().parse_args([])
    del args.role
    assert engine_config_from_args(args).cache.window_pool
