"""The tiers below the KV pool (engine_worker/kv_offload.py): blocks the pool evicts
kept in host memory or on disk, and copied back instead of computed, token-identical;
a bad block on disk refused; a disk tier found again by the next engine, never by an
engine of another layout."""

from __future__ import annotations

import shutil

import pytest

from common.kv_disk import DiskTier
from engine_worker.kv_offload import HostTier
from helpers import greedy, make_engine, random_prompts

# Blocks of 4 tokens; a pool of 16 holds one 41-token prompt and its reply, not two.
POOL = dict(block_size=4, num_blocks=16, max_model_len=128)
A, B, C = random_prompts([41, 41, 41], seed=7)
FULL = (len(A) - 1) // 4   # A's blocks looked up (its last token is always computed)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """Each prompt's greedy tokens from an engine with no tier (and a pool to spare)."""
    ref = make_engine(tiny_llama_dir, num_blocks=256, max_model_len=128)
    return {i: ref.generate([p], greedy(6))[0] for i, p in enumerate((A, B, C))}


def evict_a_then_ask_again(engine, expected):
    """A, then B and C (which evict A's blocks from the pool), then A again: every
    output as without tiers. The prompt tokens A's second turn computed."""
    for i, prompt in enumerate((A, B, C)):
        assert engine.generate([prompt], greedy(6))[0] == expected[i]
    assert engine.block_manager.lookup(engine_hashes(engine, A)[0]) is None  # evicted
    before = engine.num_prompt_tokens_computed
    assert engine.generate([A], greedy(6))[0] == expected[0]
    return engine.num_prompt_tokens_computed - before


def engine_hashes(engine, prompt):
    from common.prefix_hash import prefix_hashes
    return prefix_hashes(prompt, engine.block_manager.block_size, 100)


def test_the_host_tier_keeps_blocks_by_budget_least_recently_used_first_out():
    tier = HostTier(budget_bytes=3 * 100 + 99, block_bytes=100, pin=False)
    assert tier.num_slots == 3
    for i in range(3):
        assert tier.slot_for(bytes([i]), (i,)) == (i, None)
    assert tier.find(bytes([0]), (0,)) is not None      # 0 now the most recent
    assert tier.find(bytes([1]), (9,)) is None          # other tokens: not this block
    slot, victim = tier.slot_for(b"\x03", (3,))
    assert victim == (bytes([1]), (1,))                 # the least recently used
    assert len(tier) == 3 and tier.nbytes == 300
    assert tier.find(bytes([1]), (1,)) is None
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(budget_bytes=99, block_bytes=100, pin=False)


def test_blocks_evicted_to_host_memory_come_back_token_identical(tiny_llama_dir, expected):
    engine = make_engine(tiny_llama_dir, **POOL, kv_offload_memory_bytes=64 << 20)
    computed = evict_a_then_ask_again(engine, expected)
    assert computed == len(A) - FULL * 4                # only the last token's block
    stats = engine.stats()
    assert stats.kv_offload_loaded == {"host": FULL}
    assert stats.kv_offload_stored["host"] >= FULL
    assert stats.kv_offload_blocks["host"] == stats.kv_offload_stored["host"]
    assert stats.kv_offload_bytes["host"] == (stats.kv_offload_blocks["host"]
                                              * engine.kv.offload.store.block_bytes)
    assert engine.block_manager.num_used_blocks == 0    # nothing held after


def test_without_a_tier_the_evicted_prefix_is_computed_again(tiny_llama_dir, expected):
    engine = make_engine(tiny_llama_dir, **POOL)
    assert evict_a_then_ask_again(engine, expected) == len(A)
    assert engine.stats().kv_offload_loaded == {}


def test_a_small_host_tier_spills_to_disk_and_both_give_blocks_back(tiny_llama_dir, expected,
                                                                  tmp_path):
    probe = make_engine(tiny_llama_dir, **POOL, kv_offload_memory_bytes=1 << 20)
    block_bytes = probe.kv.offload.store.block_bytes
    engine = make_engine(tiny_llama_dir, **POOL, kv_offload_memory_bytes=4 * block_bytes,
                         kv_offload_dir=str(tmp_path))
    for prompt in (A, B, C):
        engine.generate([prompt], greedy(6))
    engine.kv.offload.disk.flush()
    assert engine.generate([A], greedy(6))[0] == expected[0]
    loaded = engine.stats().kv_offload_loaded
    assert loaded["disk"] > 0 and loaded.get("host", 0) + loaded["disk"] == FULL


def test_the_disk_tier_is_found_again_by_the_next_engine(tiny_llama_dir, expected, tmp_path):
    first = make_engine(tiny_llama_dir, **POOL, kv_offload_dir=str(tmp_path))
    assert first.generate([A], greedy(6))[0] == expected[0]
    first.kv.shutdown()   # the pool's cached blocks left on disk
    second = make_engine(tiny_llama_dir, **POOL, kv_offload_dir=str(tmp_path))
    assert len(second.kv.offload.disk) >= FULL
    before = second.num_prompt_tokens_computed
    assert second.generate([A], greedy(6))[0] == expected[0]
    assert second.num_prompt_tokens_computed - before == len(A) - FULL * 4
    assert second.stats().kv_offload_loaded == {"disk": FULL}


def test_a_bad_block_on_disk_is_refused_deleted_and_computed(tiny_llama_dir, expected,
                                                            tmp_path):
    first = make_engine(tiny_llama_dir, **POOL, kv_offload_dir=str(tmp_path))
    first.generate([A], greedy(6))
    first.kv.shutdown()
    second = make_engine(tiny_llama_dir, **POOL, kv_offload_dir=str(tmp_path))
    bad = second.kv.offload.disk.path(engine_hashes(second, A)[3])
    raw = bytearray(bad.read_bytes())
    raw[-5] ^= 0x40   # one bit of the fourth block's values
    bad.write_bytes(bytes(raw))
    before = second.num_prompt_tokens_computed
    assert second.generate([A], greedy(6))[0] == expected[0]
    stats = second.stats()
    assert stats.kv_offload_loaded == {"disk": 3}        # the three before it
    assert stats.kv_offload_errors == {"disk_checksum": 1}
    assert second.num_prompt_tokens_computed - before == len(A) - 3 * 4
    assert not bad.exists()


def test_a_disk_tier_of_another_layout_is_never_read(tiny_llama_dir, tiny_llama_hd8_dir,
                                                     tmp_path):
    first = make_engine(tiny_llama_dir, **POOL, kv_offload_dir=str(tmp_path))
    first.generate([A], greedy(6))
    first.kv.shutdown()
    # Another model; the same in blocks of another size; the same with other weights
    # (one value of its last tensor changed in place): their own directories.
    retrained = tmp_path / "retrained" / tiny_llama_dir.name   # (the same model name)
    shutil.copytree(tiny_llama_dir, retrained)
    [weights] = retrained.glob("*.safetensors")
    raw = bytearray(weights.read_bytes())
    raw[-2] ^= 0x01
    weights.write_bytes(bytes(raw))
    for other in (make_engine(tiny_llama_hd8_dir, **POOL, kv_offload_dir=str(tmp_path)),
                  make_engine(tiny_llama_dir, **{**POOL, "block_size": 8},
                              kv_offload_dir=str(tmp_path)),
                  make_engine(retrained, **POOL, kv_offload_dir=str(tmp_path))):
        assert other.kv.offload.disk.dir != first.kv.offload.disk.dir
        assert len(other.kv.offload.disk) == 0
        other.generate([A], greedy(6))
        assert other.stats().kv_offload_loaded == {}
    (first.kv.offload.disk.dir / "LAYOUT").write_text("another model's")
    with pytest.raises(ValueError, match="another layout"):
        DiskTier(str(tmp_path), first.kv.offload.store.layout, 1 << 20, 100)


def test_offload_needs_the_prefix_cache(tiny_llama_dir):
    with pytest.raises(ValueError, match="prefix cache"):
        make_engine(tiny_llama_dir, **POOL, prefix_caching=False, kv_offload_memory_bytes=1 << 20)
