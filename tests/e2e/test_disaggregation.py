"""Prefill/decode disaggregation between real engine processes: the KV blocks go from
the prefill engine to the decode engine over their own ZeroMQ connection, and every
fault on the way ends in the decode engine computing the rest itself (token-identical
output, no leaked blocks on either engine)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import psutil
import pytest

from benchmarks.stack import metric, scrape
from common.protocol import KvSource, SamplingParams
from engine_worker_helpers import connect, run, token_ids, wait_idle
from helpers import greedy, make_engine, random_prompts
from processes import Serve

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
        await p.close()  # (an unclosed client's context blocks whoever collects it)
        return ids, first, stats

    ids, first, stats = run(main())
    assert ids == expected
    assert first.kv_outcome in ("disconnected", "source_dead")
    assert first.kv_blocks_received == 8
    assert first.kv_transfer_ms < 10_000  # noticed at once, not at the 30 s deadline
    assert stats.num_blocks_used == 0
    assert prefill.proc.wait(timeout=10) == 9


# -- through the frontend: roseserve serve --prefill-engines 1 --decode-engines 1 -------

HTTP_PROMPTS = random_prompts([23, 40, 9, 64], seed=31)
SHARED = random_prompts([24], seed=32)[0]
HTTP_PROMPTS += [SHARED + tail for tail in random_prompts([6, 13], seed=33)]


def complete(url: str, prompt, max_tokens: int, stream: bool = False, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **kw}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["token_ids"], body["timing"]
    ids, timing, error = [], None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            for c in event["choices"]:
                ids += c.get("token_ids") or []
            timing = event.get("timing", timing)
    return ids, timing if error is None else error


def engine_pid(role: str) -> int:
    """The pid of this test's engine process of ``role``."""
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "engine_worker" in cmd and cmd[cmd.index("--role") + 1] == role:
            return proc.pid
    raise LookupError(role)


def engine_address(url: str, role: str) -> str:
    [address] = re.findall(r'roseserve_engine_role\{engine="([^"]+)",role="%s"\}' % role,
                           scrape(url))
    return address


# The engines' figures in /metrics are as of their last heartbeat (every second).
HEARTBEAT_S = 1.5


def kv_idle(url: str) -> bool:
    """Both engines as they started: no block used, no lease, nothing running (as of
    the last heartbeat: wait HEARTBEAT_S after the event first)."""
    text = scrape(url)
    return (metric(text, "roseserve_engine_kv_blocks", state="used") == 0
            and metric(text, "roseserve_kv_leases") == 0
            and metric(text, "vllm:num_requests_running") == 0)


@pytest.fixture
def pd_serve(tiny_llama_dir, tmp_path, request):
    """``roseserve serve`` with one prefill and one decode engine; extra flags and
    ROSESERVE_FAULT_* from the test's ``serve`` marker."""
    marker = request.node.get_closest_marker("serve")
    args, env = (marker.args if marker else ((), None))
    s = Serve(tiny_llama_dir, tmp_path / "serve.log", "--prefill-engines", "1",
              "--decode-engines", "1", "--disagg-min-prompt-tokens", "0", *args,
              engines=None, env=env)
    s.wait_ready()
    yield s
    s.stop()


def wait_until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)


def test_http_token_identical_to_a_mixed_engine(pd_serve, tiny_llama_dir):
    expected = make_engine(tiny_llama_dir).generate(HTTP_PROMPTS, greedy(10))
    got = [complete(pd_serve.url, p, 10, stream=i % 2 == 1) for i, p in enumerate(HTTP_PROMPTS)]
    assert [ids for ids, _ in got] == expected
    for (_, timing), prompt in zip(got, HTTP_PROMPTS):
        assert timing["prefill_engine"].endswith("engine-0.sock")
        assert timing["engine"].endswith("engine-1.sock")
        assert timing["kv_outcome"] == ("complete" if len(prompt) >= 4 else None)
        assert timing["kv_transfer_ms"] is None or timing["kv_transfer_ms"] >= 0
    # The second prompt sharing SHARED finds its 6 blocks on the decode engine already.
    received = sum(len(p) // 4 for p in HTTP_PROMPTS) - len(SHARED) // 4
    wait_until(lambda: metric(scrape(pd_serve.url), "roseserve_kv_transfer_blocks_total",
                              direction="received") == received)  # as of a heartbeat
    text = scrape(pd_serve.url)
    assert metric(text, "roseserve_kv_transfer_blocks_total", direction="received") == received
    assert metric(text, "roseserve_kv_transfer_blocks_total", direction="skipped") == 6
    assert metric(text, "roseserve_kv_transfer_fallbacks_total") == 0
    assert metric(text, "roseserve_engine_role", role="prefill") == 1
    time.sleep(HEARTBEAT_S)
    wait_until(lambda: kv_idle(pd_serve.url))


def test_http_max_tokens_1_and_short_prompts_stay_on_one_engine(pd_serve, tiny_llama_dir):
    [prompt] = random_prompts([12], seed=34)
    expected = make_engine(tiny_llama_dir).generate([prompt], greedy(1))[0]
    ids, timing = complete(pd_serve.url, prompt, 1)
    assert ids == expected and timing["kv_outcome"] is None  # nothing for a decode engine
    # The frontend let go of the prompt's blocks at once (the lease is 30 s).
    time.sleep(HEARTBEAT_S)
    wait_until(lambda: kv_idle(pd_serve.url), timeout_s=5)


@pytest.mark.serve(("--kv-transfer-timeout", "1"), {"ROSESERVE_FAULT_KV": "corrupt"})
def test_http_a_corrupt_block_is_computed_again(pd_serve, tiny_llama_dir):
    expected = make_engine(tiny_llama_dir).generate(HTTP_PROMPTS[:3], greedy(6))
    got = [complete(pd_serve.url, p, 6, stream=True) for p in HTTP_PROMPTS[:3]]
    assert [ids for ids, _ in got] == expected
    assert {t["kv_outcome"] for _, t in got} == {"checksum"}
    # Engine figures are as of each engine's last heartbeat.
    wait_until(lambda: metric(scrape(pd_serve.url), "roseserve_kv_transfer_fallbacks_total",
                              reason="checksum") == 3)
    time.sleep(HEARTBEAT_S)
    wait_until(lambda: kv_idle(pd_serve.url))


@pytest.mark.serve(("--kv-transfer-timeout", "30"), {"ROSESERVE_FAULT_KV": "delay:5"})
def test_http_client_leaving_mid_transfer_frees_both_engines(pd_serve):
    body = {"model": "tiny", "prompt": HTTP_PROMPTS[3], "max_tokens": 50, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{pd_serve.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"text"' in line:  # the first token, from the prefill engine
                break
        # The decode engine is pulling; the prefill engine's answer is 5 s away.
        wait_until(lambda: metric(scrape(pd_serve.url), "roseserve_kv_transfers_total") == 1)
    # The decode engine lets go at once (well before the prefill engine's answer)...
    decode = engine_address(pd_serve.url, "decode")
    wait_until(lambda: metric(scrape(pd_serve.url), "roseserve_engine_kv_blocks",
                              engine=decode, state="used") == 0, timeout_s=4)
    # ...the prefill engine, stuck in its slow answer, when it reads the release that
    # followed the pull.
    time.sleep(HEARTBEAT_S)
    wait_until(lambda: kv_idle(pd_serve.url))


def test_http_prefill_engine_killed(pd_serve, tiny_llama_dir):
    expected = make_engine(tiny_llama_dir).generate(HTTP_PROMPTS[:2], greedy(8))
    os.kill(engine_pid("prefill"), signal.SIGKILL)
    # Requests in flight or new: the decode engine computes everything, nothing fails.
    got = [complete(pd_serve.url, p, 8, stream=True) for p in HTTP_PROMPTS[:2]]
    assert [ids for ids, _ in got] == expected
    wait_until(lambda: metric(scrape(pd_serve.url), "roseserve_engine_healthy") == 2, 60)


@pytest.mark.serve(("--kv-transfer-timeout", "30"), {"ROSESERVE_FAULT_STEP_DELAY_S": "0.05"})
def test_http_decode_engine_killed_mid_stream_continues_elsewhere(pd_serve):
    """The decode engine's death mid-stream: the stream fails over (to the prefill
    engine, the only one left, or to the decode engine restarted) and goes on token
    for token, with no error event."""
    body = {"model": "tiny", "prompt": HTTP_PROMPTS[1], "max_tokens": 200, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True}
    r = httpx.post(f"{pd_serve.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reference = r.json()["choices"][0]["token_ids"]
    errors, token_ids, killed = [], [], None
    with httpx.stream("POST", f"{pd_serve.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            for choice in chunk.get("choices", []):
                token_ids += choice.get("token_ids") or []
            if killed is None and len(token_ids) >= 5:
                os.kill(engine_pid("decode"), signal.SIGKILL)
                killed = time.monotonic()
    assert killed is not None and time.monotonic() - killed < 30
    assert errors == [] and token_ids == reference
    # The prefill engine let go of the prompt's blocks; the decode engine, restarted by
    # the launcher, starts with none in use.
    time.sleep(HEARTBEAT_S)
    wait_until(lambda: kv_idle(pd_serve.url), timeout_s=60)
