"""Prefill/decode disaggregation between real engine processes: the KV blocks go from
the prefill engine to the decode engine over their own ZeroMQ connection, and every
fault on the way ends in the decode engine computing the rest itself (token-identical
output, no leaked blocks on either engine)."""

from __future__ import annotations

import asyncio

import pytest

from common.protocol import KvSource, SamplingParams
from engine_worker_helpers import connect, run, token_ids, wait_idle
from helpers import greedy, make_engine, random_prompts

PROMPTS = random_prompts([23, 40, 9, 64], seed=21)


async def collect(client, request_id, prompt, params, **kw):
    return [out async for out in client.generate(request_id, prompt, params, **kw)]


async def disaggregated(prefill, decode, request_id, prompt, params):
    """The frontend's part, by hand: the first token from the prefill engine, the rest
    from the decode engine, which pulls the prompt's KV from the prefill engine."""
    first = await collect(prefill, request_id, prompt,
                          SamplingParams(**{**_fields(params), "max_tokens": 1}),
                          kv_lease_s=30.0)
    first_ids = token_ids(first)
    rest = await collect(decode, request_id, prompt, params, output_token_ids=first_ids,
                         kv_source=KvSource(address=prefill.address, request_id=request_id))
    return first_ids + token_ids(rest), rest[0]


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def _run_all(prefill_address, decode_address, params, concurrently=True):
    async def main():
        prefill = await connect(prefill_address)
        decode = await connect(decode_address)
        assert (prefill.ready.role, decode.ready.role) == ("prefill", "decode")
        jobs = [disaggregated(prefill, decode, f"r{i}", p, params)
                for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*jobs)
        stats = [await wait_idle(c) for c in (prefill, decode)]
        await asyncio.sleep(0.3)  # a release pull in flight lands
        stats = [(await c.ping()).stats for c in (prefill, decode)]
        await prefill.close()
        await decode.close()
        return results, stats

    return run(main())


def test_token_identical_to_one_engine_over_real_sockets(engine_factory, tiny_llama_dir):
    expected = make_engine(tiny_llama_dir).generate(PROMPTS, greedy(8))
    prefill = engine_factory("--role", "prefill", name="prefill")
    decode = engine_factory("--role", "decode", name="decode")
    results, (p_stats, d_stats) = _run_all(prefill.address, decode.address, greedy(8))
    assert [ids for ids, _ in results] == expected
    full_blocks = [len(p) // 4 for p in PROMPTS]
    assert [first.kv_blocks_received for _, first in results] == full_blocks
    assert {first.kv_outcome for _, first in results} == {"complete"}
    assert p_stats.kv_blocks_sent == d_stats.kv_blocks_received == sum(full_blocks)
    assert d_stats.kv_fallbacks == {}
    # Nothing held once every request ended: no lease, no reserved block.
    assert p_stats.kv_leases == 0 and p_stats.num_blocks_used == 0
    assert d_stats.num_blocks_used == 0


@pytest.mark.parametrize("fault, outcome", [
    ("corrupt", "checksum"),
    ("drop", "hash"),
    ("delay:1.5", "deadline"),
])
def test_a_spoiled_transfer_falls_back_and_the_output_is_unchanged(
        engine_factory, tiny_llama_dir, fault, outcome):
    expected = make_engine(tiny_llama_dir).generate(PROMPTS, greedy(6))
    prefill = engine_factory("--role", "prefill", name="prefill",
                             env={"ROSESERVE_FAULT_KV": fault})
    decode = engine_factory("--role", "decode", "--kv-transfer-timeout", "1", name="decode")
    results, (p_stats, d_stats) = _run_all(prefill.address, decode.address, greedy(6))
    assert [ids for ids, _ in results] == expected
    assert {first.kv_outcome for _, first in results} == {outcome}
    assert d_stats.kv_fallbacks == {outcome: len(PROMPTS)}
    assert d_stats.num_blocks_used == 0
    if outcome != "deadline":  # a late answer releases nothing yet; the lease expires
        assert p_stats.kv_leases == 0 and p_stats.num_blocks_used == 0


def test_the_prefill_engine_dying_mid_transfer(engine_factory, tiny_llama_dir):
    prompt = random_prompts([200], seed=22)[0]
    expected = make_engine(tiny_llama_dir).generate([prompt], greedy(5))[0]
    # Windows of 4 blocks (2 KiB each): the 50-block prompt takes 13 pulls; the
    # prefill engine dies at the 3rd.
    prefill = engine_factory("--role", "prefill", name="prefill",
                             env={"ROSESERVE_FAULT_KV": "exit:2"})
    decode = engine_factory("--role", "decode", "--kv-transfer-timeout", "30",
                            "--kv-transfer-window-bytes", "8192", name="decode")

    async def main():
        p = await connect(prefill.address)
        d = await connect(decode.address)
        ids, first = await disaggregated(p, d, "dies", prompt, greedy(5))
        stats = await wait_idle(d)
        await d.close()
        return ids, first, stats

    ids, first, stats = run(main())
    assert ids == expected
    assert first.kv_outcome in ("disconnected", "source_dead")
    assert first.kv_blocks_received == 8
    assert first.kv_transfer_ms < 10_000  # noticed at once, not at the 30 s deadline
    assert stats.num_blocks_used == 0
    assert prefill.proc.wait(timeout=10) == 9
