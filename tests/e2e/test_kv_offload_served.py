"""The tiers below the KV pool and the shared KV store, served (``roseserve serve
--kv-offload-memory --kv-offload-dir``, ``--kv-store``): a prompt's blocks evicted from
a small pool come back from host memory, then, after the whole server restarts, from
disk; a prefix one engine computed is pulled by another from the store; every output
is HF's, the store killed or not."""

from __future__ import annotations

import os
import signal
import time

import httpx

from common.prefix_hash import prefix_hashes
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
                              ).kv.offload.store.block_bytes
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


def test_a_prefix_computed_on_one_engine_is_served_on_the_other_from_the_store(
        tiny_llama_dir, tmp_path):
    """Two engines in turn (round-robin) and ``--kv-store``: the second turn of a
    conversation lands on the other engine and pulls the first turn's blocks from the
    store; then the store is killed (its supervisor restarts it, empty) and every
    request still completes with HF's tokens."""
    second = A + [101, 102, 103, 104, 105]
    expected = [ref.token_ids for ref in hf_greedy(tiny_llama_dir, [A, second, B], 6)]
    serve = Serve(tiny_llama_dir, tmp_path / "serve.log", "--routing", "round-robin",
                  "--kv-store", "--kv-store-memory", "0.01", engines=2)
    try:
        serve.wait_ready()
        assert complete(serve.url, A) == expected[0]         # engine 0 computes it
        assert complete(serve.url, second) == expected[1]    # engine 1: A's blocks pulled
        time.sleep(1.5)
        assert metric(serve.url, "roseserve_kv_store_hits_total") == FULL
        assert metric(serve.url, "roseserve_kv_store_up") == 2
        # The engines' puts, as the router knows them: every full block either turn
        # computed (the last token's KV never is).
        put = {h for tokens in (A + expected[0], second + expected[1])
               for h in prefix_hashes(tokens[:-1], 4, 100)}
        assert metric(serve.url, "roseserve_kv_store_blocks_known") == len(put) == 13
        [store] = serve.pids()["kv_store"]
        os.kill(store, signal.SIGKILL)
        for prompt, tokens in ((B, expected[2]), (second, expected[1]), (A, expected[0])):
            assert complete(serve.url, prompt) == tokens
        deadline = time.monotonic() + 30   # restarted by the supervisor
        while serve.pids()["kv_store"] in ([], [store]):
            assert time.monotonic() < deadline, serve.log()[-3000:]
            time.sleep(0.2)
    finally:
        serve.stop()
