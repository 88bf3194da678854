"""The tiers below the KV pool, served (``roseserve serve --kv-offload-memory
--kv-offload-dir``): a prompt's blocks evicted from a small pool come back from host
memory, then, after the whole server restarts, from disk, and every output is HF's."""

from __future__ import annotations

import time

import httpx

from helpers import make_engine, random_prompts
from hf_reference import hf_greedy
from processes import Serve, metric

# Blocks of 4 tokens (Serve's); a pool of 16 holds one 41-token prompt and its reply.
A, B, C = random_prompts([41, 41, 41], seed=7)
FULL = (len(A) - 1) // 4


def complete(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def loaded(url: str, tier: str) -> float:
    """Blocks copied back from ``tier``, as of the engine's next heartbeat."""
    time.sleep(1.5)
    return metric(url, "roseserve_kv_offload_loaded_blocks_total", tier=tier)


def test_evicted_blocks_come_back_from_memory_then_from_disk_after_a_restart(
        tiny_llama_dir, tmp_path):
    expected = {i: ref.token_ids for i, ref in
                enumerate(hf_greedy(tiny_llama_dir, [A, B, C], 6))}
    block_bytes = make_engine(tiny_llama_dir, kv_offload_memory_bytes=1 << 20
                              ).kv_offload.store.block_bytes
    flags = ("--kv-cache-memory-gb", f"{16.5 * block_bytes / 2**30:.12f}",
             "--kv-offload-memory-gb", "0.01", "--kv-offload-dir", str(tmp_path / "kv"))
    serve = Serve(tiny_llama_dir, tmp_path / "serve.log", *flags)
    try:
        serve.wait_ready()
        for i, prompt in enumerate((A, B, C)):   # B and C evict A's blocks from the pool
            assert complete(serve.url, prompt) == expected[i]
        assert complete(serve.url, A) == expected[0]
        assert loaded(serve.url, "host") == FULL
    finally:
        serve.stop()   # the engine drains and leaves its cache on disk
    serve = Serve(tiny_llama_dir, tmp_path / "again.log", *flags)
    try:
        serve.wait_ready()
        assert complete(serve.url, A) == expected[0]
        assert loaded(serve.url, "disk") == FULL
        assert metric(serve.url, "vllm:prefix_cache_hits_total") == FULL * 4
    finally:
        serve.stop()
