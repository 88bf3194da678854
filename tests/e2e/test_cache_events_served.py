"""KV cache events from real engine processes: each client mirrors the engine's prefix
cache exactly through evictions, resyncs after a gap, and an engine without a prefix
cache sends none; the event log and the router in process:
tests/unit/test_cache_events.py."""

from __future__ import annotations

import asyncio

from common.prefix_hash import prefix_hashes
from engine_worker_helpers import connect, run, wait_idle
from helpers import greedy, random_prompts


def test_clients_mirror_the_engines_cache_exactly_through_evictions(engine_factory):
    """A client connected throughout keeps, change by change, exactly what a client
    connecting afterwards gets in one snapshot, while a small KV pool evicts."""
    proc = engine_factory("--kv-cache-memory", "0.0003", "--max-model-len", "256")
    prompts = random_prompts([70] * 12, seed=3)

    async def main():
        a = await connect(proc.address)
        blocks, size = a.ready.num_kv_blocks, a.ready.block_size
        assert a.ready.prefix_caching
        for i, p in enumerate(prompts):
            async for _ in a.generate(f"r{i}", p, greedy(4)):
                pass
        stats = await wait_idle(a)
        b = await connect(proc.address, client_id="late")
        await asyncio.sleep(0.2)
        result = (blocks, size, set(a.cache.held), a.cache.seq, set(b.cache.held),
                  b.cache.seq, stats)
        await a.close()
        await b.close()
        return result

    blocks, size, held_a, seq_a, held_b, seq_b, stats = run(main())
    assert 12 * (74 // size) > blocks  # the full blocks do not all fit: some were evicted
    assert held_a == held_b and seq_a == seq_b > 0
    assert len(held_a) == stats.num_blocks_cached <= blocks
    assert set(prefix_hashes(prompts[-1], size, 256)) <= held_a  # the latest prompt is held
    assert not set(prefix_hashes(prompts[0], size, 256)) & held_a  # the first was evicted


def test_a_client_that_missed_changes_resyncs(engine_factory):
    proc = engine_factory()
    prompts = random_prompts([40, 40], seed=4)

    async def main():
        client = await connect(proc.address)
        async for _ in client.generate("r0", prompts[0], greedy(2)):
            pass
        seq = client.cache.seq
        client.cache.seq -= 1  # as if the last change had been lost
        async for _ in client.generate("r1", prompts[1], greedy(2)):
            pass
        for _ in range(100):  # the snapshot follows the gap
            if client.cache.seq > seq:
                break
            await asyncio.sleep(0.02)
        result = (client.cache.num_resyncs, client.cache.seq > seq, set(client.cache.held),
                  client.ready.block_size)
        await client.close()
        return result

    resyncs, synced, held, size = run(main())
    assert resyncs == 1 and synced
    assert held >= set(prefix_hashes(prompts[0], size, 256)) | set(
        prefix_hashes(prompts[1], size, 256))


def test_an_engine_without_a_prefix_cache_sends_no_events(engine_factory):
    proc = engine_factory("--no-prefix-cache")

    async def main():
        client = await connect(proc.address)
        async for _ in client.generate("r0", random_prompts([40], seed=1)[0], greedy(2)):
            pass
        result = client.ready.prefix_caching, client.cache.seq
        await client.close()
        return result

    assert run(main()) == (False, None)
