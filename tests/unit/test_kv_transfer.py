"""Prefill/decode disaggregation inside the engines (engine_worker/kv_transfer.py): a
prefill engine computes the prompt and the first token, a decode engine pulls the
prompt's blocks and continues. Messages are carried by hand here, so that every fault
can be placed exactly; tests/e2e/test_disaggregation.py runs the real processes."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from common.errors import InvalidRequestError
from common.protocol import KvBlock, KvBlocks, KvSource, SamplingParams
from helpers import greedy, make_engine, random_prompts, run_to_end, tokens

ADDRESS = "ipc:///prefill-engine"


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """A mixed engine (the reference), a prefill engine and a decode engine."""
    return [make_engine(tiny_llama_dir, num_blocks=96, max_model_len=256) for _ in range(3)]


@pytest.fixture(autouse=True)
def clean(engines):
    """Every test leaves every engine's pool as it found it: nothing leaks."""
    for e in engines:
        e.block_manager.reset_prefix_cache()
    yield
    for e in engines:
        assert not e.has_unfinished_requests()
        assert not e.kv.leases.leases and not e.kv.receiver.transfers
        assert e.block_manager.num_used_blocks == 0, e


def prefill(p, request_id, prompt, params, lease_s=30.0):
    """The prefill engine's part: the first token, blocks held under a lease."""
    p.add_request(request_id, prompt, msgspec.structs.replace(params, max_tokens=1),
                  kv_lease_s=lease_s)
    outs = run_to_end(p)[request_id]
    return tokens(outs)


def carry(p, d, fault=None):
    """Deliver the decode engine's pulls to the prefill engine and the answers back
    until none is left; ``fault(reply) -> reply or None`` may tamper or drop."""
    while True:
        pulls = d.kv.pulls()
        if not pulls:
            return
        for address, pull in pulls:
            assert address == ADDRESS
            reply = p.kv.answer(pull)
            if fault is not None and reply.blocks:  # not a release's empty answer
                reply = fault(reply)
            if reply is not None:
                d.kv.receive(address, reply)


def disaggregated(p, d, request_id, prompt, params, fault=None):
    first = prefill(p, request_id, prompt, params)
    d.add_request(request_id, prompt, params, output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id=request_id))
    carry(p, d, fault)
    outs = run_to_end(d)[request_id]
    return first + tokens(outs), outs[0]


def test_decode_continues_from_the_prefill_engine_token_identical(engines):
    mixed, p, d = engines
    for i, prompt in enumerate(random_prompts([10, 33, 4, 3], seed=1)):
        expected = mixed.generate([prompt], greedy(12))[0]
        got, first_out = disaggregated(p, d, f"r{i}", prompt, greedy(12))
        assert got == expected
        full = len(prompt) // 4
        assert first_out.kv_outcome == ("complete" if full else None)
        assert first_out.kv_blocks_received == (full if full else None)
        # The decode engine computed only what follows the received blocks.
        assert first_out.num_cached_tokens == full * 4
        p.block_manager.reset_prefix_cache()
        d.block_manager.reset_prefix_cache()
    assert p.stats().kv_blocks_sent == d.stats().kv_blocks_received == 2 + 8 + 1
    assert d.stats().kv_bytes_received == 11 * d.kv.receiver.store.block_bytes
    assert not d.stats().kv_fallbacks


def test_only_blocks_the_decode_engine_lacks_are_pulled(engines):
    mixed, p, d = engines
    shared = random_prompts([16], seed=2)[0]
    a, b = (shared + tail for tail in random_prompts([5, 9], seed=3))
    d.generate([a], greedy(2))  # the decode engine holds the shared prefix now
    skipped, received = d.stats().kv_blocks_skipped, d.stats().kv_blocks_received
    got, first_out = disaggregated(p, d, "b", b, greedy(8))
    assert got == mixed.generate([b], greedy(8))[0]
    assert d.stats().kv_blocks_skipped - skipped == 4  # 16 shared tokens
    assert d.stats().kv_blocks_received - received == 2  # the rest of b's 25 tokens
    assert first_out.num_cached_tokens == 24


def test_the_cached_prefix_is_held_while_the_rest_arrives(engines):
    """The decode engine holds a prompt's first blocks and pulls the rest; requests run
    meanwhile evict every block the pool can give: the cached prefix stays (held with
    the transfer), so the pulled blocks after it are used."""
    mixed, p, d = engines
    prompt = random_prompts([40], seed=5)[0]
    d.generate([prompt[:20]], greedy(1))          # its first 5 blocks cached on d
    first = prefill(p, "held", prompt, greedy(6))
    d.add_request("held", prompt, greedy(6), output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id="held"))
    for i, other in enumerate(random_prompts([250, 250], seed=6)):   # 63 blocks each
        d.add_request(f"other-{i}", other, greedy(1))
        while f"other-{i}" in d.requests:
            d.step()
    carry(p, d)
    outs = run_to_end(d)["held"]
    assert first + tokens(outs) == mixed.generate([prompt], greedy(6))[0]
    assert outs[0].num_cached_tokens == 40        # 5 blocks held, 5 pulled (0 unheld)


def test_blocks_received_for_a_waiting_request_never_keep_the_first_out(engines,
                                                                        tiny_llama_dir):
    """A transfer fills most of a small pool for one request while another, queued
    first, needs more than is left: the received blocks go back to the cache (as
    they must: nothing runs, nothing else would free any) and both complete."""
    mixed, p, _ = engines
    d = make_engine(tiny_llama_dir, num_blocks=24, max_model_len=64)
    pulled, direct = random_prompts([60, 50], seed=8)
    first = prefill(p, "pulled", pulled, greedy(2))
    d.add_request("pulled", pulled, greedy(2), output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id="pulled"))
    d.add_request("direct", direct, greedy(2))      # queued while the blocks arrive
    carry(p, d)                                     # 15 of 24 blocks now held for "pulled"
    outs: dict = {}
    for _ in range(200):
        if not d.has_unfinished_requests():
            break
        for out in d.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not d.has_unfinished_requests(), "stuck"
    assert outs["direct"] == mixed.generate([direct], greedy(2))[0]
    assert first + outs["pulled"] == mixed.generate([pulled], greedy(2))[0]
    assert d.block_manager.num_used_blocks == 0


def test_seeded_sampling_continues_the_same_random_stream(engines):
    mixed, p, d = engines
    prompt = random_prompts([13], seed=4)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    expected = mixed.generate([prompt], params)[0]
    got, _ = disaggregated(p, d, "seeded", prompt, params)
    assert got == expected
    # A different seed gives another stream: the comparison above can fail.
    other = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    assert mixed.generate([prompt], other)[0] != expected


def _corrupt_one_byte(reply: KvBlocks) -> KvBlocks:
    b = reply.blocks[1]
    data = bytearray(b.data)
    data[len(data) // 2] ^= 0x01
    return msgspec.structs.replace(reply, blocks=[reply.blocks[0], KvBlock(
        b.block_hash, b.checksum, bytes(data))] + reply.blocks[2:])


def _drop_second_block(reply: KvBlocks) -> KvBlocks:
    return msgspec.structs.replace(reply, blocks=[reply.blocks[0]] + reply.blocks[2:])


def _truncate(reply: KvBlocks) -> KvBlocks:
    b = reply.blocks[1]
    return msgspec.structs.replace(reply, blocks=[reply.blocks[0], KvBlock(
        b.block_hash, b.checksum, b.data[:-4])])


@pytest.mark.parametrize("fault, outcome, received", [
    (_corrupt_one_byte, "checksum", 1),
    (_drop_second_block, "hash", 1),
    (_truncate, "size", 1),
    (lambda reply: msgspec.structs.replace(reply, blocks=[], error="gone"), "source", 0),
])
def test_a_bad_block_is_never_used_and_the_rest_is_computed(engines, fault, outcome, received):
    mixed, p, d = engines
    prompt = random_prompts([21], seed=5)[0]
    expected = mixed.generate([prompt], greedy(10))[0]
    got, first_out = disaggregated(p, d, "faulty", prompt, greedy(10), fault)
    assert got == expected
    assert first_out.kv_outcome == outcome
    assert first_out.kv_blocks_received == received
    assert first_out.num_cached_tokens == received * 4
    assert d.stats().kv_fallbacks[outcome] >= 1
    carry(p, d)  # the decode engine lets the prefill engine's lease go


def test_a_transfer_past_its_deadline_falls_back(engines, monkeypatch):
    mixed, p, d = engines
    prompt = random_prompts([18], seed=6)[0]
    expected = mixed.generate([prompt], greedy(6))[0]
    first = prefill(p, "late", prompt, greedy(6))
    d.add_request("late", prompt, greedy(6), output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id="late"))
    pulls = d.kv.pulls()
    assert len(pulls) == 1 and not d.has_steps_to_run()  # waiting for its KV
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + d.config.cache.kv_transfer_timeout_s)
    assert d.kv.expire() is None
    monkeypatch.undo()
    assert d.has_steps_to_run()
    reply = p.kv.answer(pulls[0][1])  # arrives late: dropped
    d.kv.receive(ADDRESS, reply)
    outs = run_to_end(d)["late"]
    assert first + tokens(outs) == expected
    assert outs[0].kv_outcome == "deadline" and outs[0].kv_blocks_received == 0
    carry(p, d)  # the lease is released


def test_the_prefill_engine_dying_mid_transfer_falls_back(engines):
    mixed, p, d = engines
    prompt = random_prompts([40], seed=7)[0]
    expected = mixed.generate([prompt], greedy(5))[0]
    first = prefill(p, "dies", prompt, greedy(5))
    d.add_request("dies", prompt, greedy(5), output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id="dies"))
    [(_, pull)] = d.kv.pulls()
    reply = p.kv.answer(msgspec.structs.replace(pull, hashes=pull.hashes[:3]))
    d.kv.receive(ADDRESS, reply)
    d.kv.source_failed(ADDRESS, "disconnected")
    outs = run_to_end(d)["dies"]
    assert first + tokens(outs) == expected
    assert outs[0].kv_outcome == "disconnected" and outs[0].kv_blocks_received == 3
    p.kv.leases.release("dies")


def test_abort_mid_transfer_frees_everything_on_both_engines(engines):
    _, p, d = engines
    prompt = random_prompts([30], seed=8)[0]
    first = prefill(p, "gone", prompt, greedy(5))
    assert p.block_manager.num_used_blocks == 7  # the lease holds 30 // 4 blocks
    d.add_request("gone", prompt, greedy(5), output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id="gone"))
    assert d.block_manager.num_used_blocks == 7  # reserved for the transfer
    d.kv.pulls()
    assert d.abort_requests(["gone"]) == ["gone"]
    assert d.block_manager.num_used_blocks == 0
    [(_, release)] = d.kv.pulls()
    assert release.release and not release.hashes
    assert p.kv.answer(release).blocks == []
    assert p.block_manager.num_used_blocks == 0


def test_a_lease_nobody_pulls_expires(engines):
    _, p, _ = engines
    prefill(p, "unclaimed", random_prompts([12], seed=11)[0], greedy(3), lease_s=0.05)
    assert p.stats().kv_leases == 1 and p.block_manager.num_used_blocks == 3
    time.sleep(0.06)
    p.kv.expire()
    assert p.stats().kv_leases == 0 and p.block_manager.num_used_blocks == 0


def test_pulls_are_windowed_and_bounded_in_flight(engines, tiny_llama_dir):
    from common.config import CacheConfig, EngineConfig
    from engine_worker.engine import LLMEngine

    block_bytes = engines[0].kv.receiver.store.block_bytes
    p, d = (LLMEngine(EngineConfig(
        model=str(tiny_llama_dir), device="cpu", max_model_len=256,
        cache=CacheConfig(block_size=4, num_blocks=96,
                          kv_transfer_window_bytes=3 * block_bytes,
                          kv_transfer_max_inflight_bytes=4 * block_bytes)))
            for _ in range(2))
    for i, prompt in enumerate(random_prompts([20, 20], seed=9)):
        first = prefill(p, f"w{i}", prompt, greedy(3))
        d.add_request(f"w{i}", prompt, greedy(3), output_token_ids=first,
                      kv_source=KvSource(address=ADDRESS, request_id=f"w{i}"))
    pulls = d.kv.pulls()
    # Windows of 3 blocks; 4 blocks in flight at most over both transfers.
    assert [len(pull.hashes) for _, pull in pulls] == [3, 1]
    assert d.kv.pulls() == []
    for _, pull in pulls:
        d.kv.receive(ADDRESS, p.kv.answer(pull))
    carry(p, d)
    outs = run_to_end(d)
    assert {o[0].kv_outcome for o in outs.values()} == {"complete"}
    assert d.stats().kv_blocks_received == 10
    assert p.block_manager.num_used_blocks == d.block_manager.num_used_blocks == 0


def test_windows_in_flight_together_and_a_source_with_smaller_windows(engines, tiny_llama_dir):
    from common.config import CacheConfig, EngineConfig
    from engine_worker.engine import LLMEngine

    mixed = engines[0]
    block_bytes = mixed.kv.receiver.store.block_bytes

    def engine(window_blocks):
        return LLMEngine(EngineConfig(
            model=str(tiny_llama_dir), device="cpu", max_model_len=256,
            cache=CacheConfig(block_size=4, num_blocks=96,
                              kv_transfer_window_bytes=window_blocks * block_bytes,
                              kv_transfer_max_inflight_bytes=9 * block_bytes)))

    p, d = engine(2), engine(3)  # the source answers at most 2 blocks a pull
    prompt = random_prompts([30], seed=14)[0]
    first = prefill(p, "s", prompt, greedy(6))
    d.add_request("s", prompt, greedy(6), output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id="s"))
    pulls = d.kv.pulls()
    # Every window of the 7 blocks asked for at once (a busy source answers them all
    # between two of its steps); only the last pull releases the lease.
    assert [len(pull.hashes) for _, pull in pulls] == [3, 3, 1]
    assert [pull.release for _, pull in pulls] == [False, False, True]
    replies = [p.kv.answer(pull) for _, pull in pulls]
    assert [len(r.blocks) for r in replies] == [2, 2, 1]
    for reply in replies:  # the 1st is short: the 2nd and 3rd answers are dropped
        d.kv.receive(ADDRESS, reply)
    assert d.kv.receiver.transfers["s"].num_done == 2
    carry(p, d)  # the rest asked for again
    outs = run_to_end(d)["s"]
    assert first + tokens(outs) == mixed.generate([prompt], greedy(6))[0]
    assert outs[0].kv_outcome == "complete" and outs[0].kv_blocks_received == 7
    assert p.block_manager.num_used_blocks == d.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kw, param", [
    (dict(output_token_ids=[50257]), "output_token_ids"),
    (dict(output_token_ids=[1, 2, 3, 4]), "output_token_ids"),  # max_tokens 4: done
    (dict(kv_lease_s=-1.0), "kv_lease_s"),
    (dict(kv_lease_s=float("nan")), "kv_lease_s"),
    (dict(kv_lease_s=1e9), "kv_lease_s"),
])
def test_bad_disaggregation_fields_are_clear_errors(engines, kw, param):
    _, _, d = engines
    with pytest.raises(InvalidRequestError) as info:
        d.add_request("bad", [1, 2, 3], greedy(4), **kw)
    assert info.value.param == param


def test_a_layout_mismatch_is_refused_by_the_prefill_engine(engines):
    mixed, p, d = engines
    prompt = random_prompts([12], seed=10)[0]
    first = prefill(p, "layout", prompt, greedy(4))
    d.add_request("layout", prompt, greedy(4), output_token_ids=first,
                  kv_source=KvSource(address=ADDRESS, request_id="layout"))
    [(_, pull)] = d.kv.pulls()
    reply = p.kv.answer(msgspec.structs.replace(pull, layout="another model"))
    assert reply.blocks == [] and "KV layout mismatch" in reply.error
    d.kv.receive(ADDRESS, reply)
    outs = run_to_end(d)["layout"]
    assert first + tokens(outs) == mixed.generate([prompt], greedy(4))[0]
    assert outs[0].kv_outcome == "source"


def test_aborting_a_finished_prefill_lets_go_of_its_lease(engines):
    # What a frontend does when the first token ended the request (or its client left).
    _, p, _ = engines
    prefill(p, "unwanted", random_prompts([12], seed=12)[0], greedy(3))
    assert p.stats().kv_leases == 1 and p.block_manager.num_used_blocks == 3
    assert p.abort_requests(["unwanted"]) == []  # finished: nothing was running
    assert p.stats().kv_leases == 0 and p.block_manager.num_used_blocks == 0


def test_chunked_prompts_and_decode_side_preemption(tiny_llama_dir):
    mixed = make_engine(tiny_llama_dir, num_blocks=256, max_model_len=256)
    p = make_engine(tiny_llama_dir, num_blocks=256, max_model_len=256, budget=8)
    # 4 requests of about 14 blocks each, 40 blocks: the decode engine must preempt.
    d = make_engine(tiny_llama_dir, num_blocks=40, max_model_len=256)
    prompts = random_prompts([30, 35, 28, 33], seed=13)
    params = greedy(24)
    expected = mixed.generate(prompts, params)
    firsts = []
    for i, prompt in enumerate(prompts):
        p.add_request(f"c{i}", prompt, msgspec.structs.replace(params, max_tokens=1),
                      kv_lease_s=30.0)
        outs = run_to_end(p)[f"c{i}"]
        assert outs[0].prefill_ms is not None
        firsts.append(tokens(outs))
    assert p.stats().num_prompt_tokens_computed == sum(map(len, prompts))
    for i, prompt in enumerate(prompts):
        d.add_request(f"c{i}", prompt, params, output_token_ids=firsts[i],
                      kv_source=KvSource(address=ADDRESS, request_id=f"c{i}"))
    carry(p, d)
    outs = run_to_end(d)
    assert [firsts[i] + tokens(outs[f"c{i}"]) for i in range(4)] == expected
    assert d.stats().num_preemptions > 0
    assert d.stats().kv_blocks_received == sum(len(q) // 4 for q in prompts)
    assert d.block_manager.num_used_blocks == 0 and p.block_manager.num_used_blocks == 0
    assert p.stats().kv_leases == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_block_moves_between_stores_as_its_bytes_in_every_cache_type(dtype):
    """A block read from one engine's caches and written into another's lands bit for
    bit, fp8 included (torch stacks and copies it only as bytes)."""
    from engine_worker.kv_transfer import KvBlockStore

    def caches(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(2, 6, 4, 2, 8, generator=gen).to(dtype) for _ in range(3)]

    source, target = KvBlockStore(caches(0), "m"), KvBlockStore(caches(1), "m")
    data = source.read(4)
    assert len(data) == source.block_bytes
    target.write(1, data)
    for src, dst in zip(source.kv_caches, target.kv_caches):
        assert torch.equal(src[:, 4].view(torch.uint8), dst[:, 1].view(torch.uint8))
    if dtype == torch.float8_e4m3fn:
        # A NaN (0x7F or 0xFF in e4m3) from a peer lands as 0: the attention kernel
        # relies on an fp8 cache holding none (engine_worker.ops.to_cache_dtype).
        nan = bytearray(data)
        nan[0], nan[5], nan[-1] = 0x7F, 0xFF, 0x7F
        target.write(2, bytes(nan))
        got = torch.stack([c[:, 2] for c in target.kv_caches]).view(torch.uint8).flatten()
        assert not got.view(dtype).float().isnan().any()
        assert got[0] == got[5] == got[-1] == 0 and torch.equal(got[6:-1], torch.frombuffer(
            bytearray(data[6:-1]), dtype=torch.uint8))


def test_engines_that_took_other_longrope_factors_do_not_share_blocks(tiny_phi4_mini_dir):
    """LongRoPE's factors are taken at start by the context served: a prefill engine
    serving 64 tokens (the short ones) and a decode engine serving 256 (the long ones)
    turn keys differently, so their layouts differ and a pull is refused."""
    short = make_engine(tiny_phi4_mini_dir, max_model_len=64)
    long = make_engine(tiny_phi4_mini_dir)
    again = make_engine(tiny_phi4_mini_dir, max_model_len=200)
    layouts = [e.kv.leases.store.layout for e in (short, long, again)]
    assert layouts[0] != layouts[1] and layouts[1] == layouts[2]
    assert "longrope=" in layouts[0]


def test_fp8_engines_share_their_scales_through_the_blocks(tiny_llama_dir):
    """An fp8 cache's scales are set by an engine's first prompt (kv_scales.py): a decode
    engine that has computed none takes its prefill engine's with their first blocks,
    so both read the same bytes alike (the tokens of an engine that ran it all); one
    whose scales are set otherwise gets no blocks and computes the prompt itself."""
    def fp8():
        return make_engine(tiny_llama_dir, num_blocks=96, max_model_len=256,
                           cpu_kernels=False, kv_cache_dtype="fp8")

    mixed, p, d = fp8(), fp8(), fp8()
    prompt = random_prompts([21], seed=14)[0]
    expected = mixed.generate([prompt], greedy(6))[0]
    assert d.kv.leases.store.layout.endswith("|uncalibrated")
    got, first_out = disaggregated(p, d, "s", prompt, greedy(6))
    assert got == expected and first_out.kv_outcome == "complete"
    assert d.runner.kv_scales.values() == p.runner.kv_scales.values() != [1.0] * 4
    assert d.kv.leases.store.layout == p.kv.leases.store.layout
    # an engine whose scales came from another prompt: its pulls are refused, and it
    # computes the prompt by its own scales (as a twin set by the same prompt does)
    other, twin = fp8(), fp8()
    for e in (other, twin):
        e.generate([random_prompts([9], seed=15)[0]], greedy(1))
    assert other.runner.kv_scales.values() != p.runner.kv_scales.values()
    second = random_prompts([17], seed=16)[0]
    got, first_out = disaggregated(p, other, "t", second, greedy(4))
    assert first_out.kv_outcome == "source"
    assert got[1:] == twin.generate([second], greedy(4))[0][1:]   # (its first: p's)
