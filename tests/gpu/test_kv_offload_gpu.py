"""The tiers below the KV pool on the GPU engine's path (engine_worker/kv_offload.py):
on CUDA the host tier is pinned memory, its copies run on a side stream the step's
stream waits for, evicted blocks reach the host (the disk tier) with no wait on the
step's path, and steps run ahead of the host (async scheduling): tokens must be the
same as without tiers. Without a GPU the same runs through Triton's interpreter (the
tiers' CPU path)."""

from __future__ import annotations

import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_worker.engine import LLMEngine
from helpers import greedy, random_prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
A, B, C = random_prompts([41, 41, 41], seed=7)
FULL = (len(A) - 1) // 4


def engine(model_dir, num_blocks: int, **cache) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), device=DEVICE, dtype="float32", attention_backend="triton",
        enforce_eager=True, max_model_len=128,
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, **cache),
        scheduler=SchedulerConfig(max_batch_size=4)))


def test_blocks_evicted_to_pinned_memory_and_disk_come_back_token_identical(tiny_llama_dir,
                                                                            tmp_path):
    ref = engine(tiny_llama_dir, 256)
    expected = [ref.generate([p], greedy(6))[0] for p in (A, B, C)]
    block_bytes = ref.kv.receiver.store.block_bytes
    # a pool of 16 blocks (one prompt and its reply), a host tier of 6 that spills
    e = engine(tiny_llama_dir, 16, kv_offload_memory_bytes=6 * block_bytes,
               kv_offload_dir=str(tmp_path))
    if DEVICE == "cuda":
        assert e.kv.offload.host.slab.is_pinned() and e.async_scheduling
    for prompt, tokens in zip((A, B, C), expected):
        assert e.generate([prompt], greedy(6))[0] == tokens
    e.kv.offload.poll()
    e.kv.offload.disk.flush()
    before = e.num_prompt_tokens_computed
    assert e.generate([A], greedy(6))[0] == expected[0]
    assert e.num_prompt_tokens_computed - before == len(A) - FULL * 4
    loaded = e.stats().kv_offload_loaded
    assert loaded.get("host", 0) + loaded.get("disk", 0) == FULL and loaded.get("disk")
    assert e.block_manager.num_used_blocks == 0
