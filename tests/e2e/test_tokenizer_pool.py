"""The tokenizer pool: real supervisor and worker processes, driven by its client."""

from __future__ import annotations

import asyncio

import pytest

import processes
from common.protocol import ChatMessage, TokenizeRequest
from common.tokenizer import load_tokenizer
from tokenizer_worker.client import TokenizeFailed, TokenizerClient
from tokenizer_worker.prompt_tokenizer import PromptTokenizer

CRASH = "CRASH-THE-WORKER"
HANG = "HANG-THE-WORKER"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def connect(address: str) -> TokenizerClient:
    client = TokenizerClient(address)
    await client.start(timeout_s=60)
    return client


@pytest.fixture
def pool_factory(tmp_path, tiny_llama_dir):
    started = []

    def start(workers: int = 2, crash_slots: str = "", name: str = "pool",
              hang_slots: str = "", extra=()):
        env = {"ROSESERVE_FAULT_CRASH_MARKER": CRASH, "ROSESERVE_FAULT_CRASH_SLOTS": crash_slots,
               "ROSESERVE_FAULT_HANG_MARKER": HANG, "ROSESERVE_FAULT_HANG_SLOTS": hang_slots}
        proc = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/{name}.sock",
                                        workers, env, *extra)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def test_prompts_and_chat_match_the_tokenizer(pool_factory, tiny_llama_dir):
    pool = pool_factory()
    tok = load_tokenizer(tiny_llama_dir)

    async def main():
        client = await connect(pool.address)
        texts = [f"prompt {i}: héllo wörld " * (i % 5 + 1) for i in range(50)]
        results = await asyncio.gather(*[client.tokenize(t) for t in texts])
        chat = await client.tokenize(messages=[ChatMessage(role="user", content="Hi there")])
        pong = await client.ping()
        await client.close()
        return texts, results, chat, pong

    texts, results, chat, pong = run(main())
    assert [r.prompt_token_ids for r in results] == [tok.encode(t) for t in texts]
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                       tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert pong.num_workers == 2 and pong.num_pending == 0 and pong.num_jobs_total == 51


def test_a_dead_worker_is_replaced_and_its_request_retried_elsewhere(pool_factory):
    pool = pool_factory(crash_slots="0")  # worker 0 dies on the marker; worker 1 does not

    async def main():
        client = await connect(pool.address)
        while (await client.ping()).num_alive < 2:
            await asyncio.sleep(0.2)
        result = await client.tokenize(f"{CRASH} please")  # idle pool: worker 0 gets it
        for _ in range(100):  # the replacement comes up
            pong = await client.ping()
            if pong.num_alive == 2:
                break
            await asyncio.sleep(0.2)
        ok = await client.tokenize("after the crash")
        await client.close()
        return result, pong, ok

    result, pong, ok = run(main())
    assert len(result.prompt_token_ids) > 0
    assert pong.num_alive == 2
    assert len(ok.prompt_token_ids) == 3
    assert "died with exit code 3" in pool.stop()


def test_a_request_that_kills_twice_fails_with_a_clear_error(pool_factory):
    pool = pool_factory(crash_slots="0,1")

    async def main():
        client = await connect(pool.address)
        with pytest.raises(TokenizeFailed) as info:
            await client.tokenize(f"{CRASH} again")
        for _ in range(100):
            if (await client.ping()).num_alive == 2:
                break
            await asyncio.sleep(0.2)
        ok = await client.tokenize("still serving")
        await client.close()
        return info.value, ok

    error, ok = run(main())
    assert "tokenizer workers died or hung 2 times while tokenizing this request" in error.message
    assert error.kind.value == "internal"
    assert len(ok.prompt_token_ids) == 2


def test_absurdly_long_text_is_refused_before_encoding(tiny_llama_dir):
    tokenizer = PromptTokenizer(tiny_llama_dir, max_chars=100)
    replies = tokenizer.tokenize([
        TokenizeRequest(request_id="long", prompt="x" * 101),
        TokenizeRequest(request_id="ok", prompt="fine"),
        TokenizeRequest(request_id="both", prompt="a", messages=[]),
    ])
    assert "101 characters, more than the limit of 100" in replies[0].message
    assert replies[1].prompt_token_ids == [38125]
    assert "exactly one of prompt and messages" in replies[2].message


async def wait_alive(client: TokenizerClient, n: int):
    for _ in range(150):
        pong = await client.ping()
        if pong.num_alive == n:
            return pong
        await asyncio.sleep(0.2)
    raise AssertionError(f"the pool never had {n} workers alive")


def test_a_hung_worker_is_replaced_and_its_job_retried(pool_factory):
    pool = pool_factory(hang_slots="0", extra=("--job-timeout", "1"))

    async def main():
        client = await connect(pool.address)
        await wait_alive(client, 2)
        started = asyncio.get_running_loop().time()
        result = await client.tokenize(f"{HANG} for worker 0")  # idle pool: worker 0 gets it
        elapsed = asyncio.get_running_loop().time() - started
        pong = await wait_alive(client, 2)
        await client.close()
        return result, elapsed, pong

    result, elapsed, pong = run(main())
    assert len(result.prompt_token_ids) > 3
    assert 1.0 < elapsed < 6.0  # the timeout, then worker 1
    assert pong.num_workers_replaced == 1
    assert "has held a job for" in pool.stop()


def test_a_request_that_hangs_every_worker_fails_with_a_clear_error(pool_factory):
    pool = pool_factory(extra=("--job-timeout", "1"))

    async def main():
        client = await connect(pool.address)
        await wait_alive(client, 2)
        hung = asyncio.create_task(client.tokenize(f"{HANG} everywhere"))
        fine = await client.tokenize("served meanwhile")
        with pytest.raises(TokenizeFailed) as info:
            await hung
        pong = await wait_alive(client, 2)
        await client.close()
        return info.value, fine, pong

    error, fine, pong = run(main())
    assert "tokenizer workers died or hung 2 times" in error.message
    assert error.kind.value == "internal"
    assert len(fine.prompt_token_ids) == 2
    assert pong.num_workers_replaced == 2


def raw_frames_then_serve(address: str, messages: list[list[bytes]]):
    """Send ``messages`` from a raw socket, then ask the pool, as a real client does,
    for its counters and to tokenize "still fine": (pong before, pong after, result)."""
    import zmq

    async def main():
        client = await connect(address)
        before = await client.ping()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        for frames in messages:
            sock.send_multipart(frames)
        await asyncio.sleep(1.0)
        sock.close(0)
        ctx.term()
        after = await client.ping()
        result = await client.tokenize("still fine")
        await client.close()
        return before, after, result

    return run(main())


def test_bad_frames_are_counted_and_an_oversized_one_costs_only_its_connection(pool_factory):
    pool = pool_factory(workers=1, extra=("--max-frame-bytes", "4096"))
    before, after, result = raw_frames_then_serve(pool.address, [
        [b"junk"], [b"\x02", b"\xc1"], [b"\x63", b"\x80"], [b"\x02", b"\x81\xa1x\x01"],
        [b"", b"", b""], [b"\x02", b"x" * 10_000]])
    assert after.num_frames_dropped - before.num_frames_dropped == 5
    assert after.num_disconnects - before.num_disconnects >= 1
    assert len(result.prompt_token_ids) == 2


def test_killing_the_supervisor_leaves_no_worker_behind(pool_factory):
    import os
    import signal
    import time

    import psutil

    pool = pool_factory(workers=2)

    async def main():
        client = await connect(pool.address)
        await wait_alive(client, 2)
        hung = asyncio.create_task(client.tokenize(f"{HANG} forever"))
        await asyncio.sleep(0.5)  # a worker is now stuck in its batch
        workers = [p for p in psutil.Process(pool.proc.pid).children()
                   if "resource_tracker" not in " ".join(p.cmdline())
                   and p.status() != psutil.STATUS_ZOMBIE]
        os.kill(pool.proc.pid, signal.SIGKILL)  # the supervisor alone
        hung.cancel()
        await client.close()
        return workers

    workers = run(main())
    assert len(workers) == 2
    deadline = time.monotonic() + 5
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
        assert time.monotonic() < deadline, "a worker outlived its supervisor"
        time.sleep(0.1)


def test_a_client_of_another_protocol_version_is_refused(pool_factory):
    import zmq

    from common.protocol import POOL_REPLIES, POOL_REQUESTS, PROTOCOL_VERSION, Codec, Dead, Hello

    pool = pool_factory(workers=1)

    async def main():
        client = await connect(pool.address)  # the current version is served
        await client.close()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pool.address)
        codec = Codec(POOL_REQUESTS, POOL_REPLIES)
        sock.send_multipart(codec.encode(Hello(client_id="old", protocol_version=PROTOCOL_VERSION + 1)))
        try:
            if not await asyncio.to_thread(sock.poll, 10_000):
                return None
            return codec.decode(sock.recv_multipart())
        finally:
            sock.close(0)
            ctx.term()

    reply = run(main())
    assert isinstance(reply, Dead)
    assert reply.reason == (f"protocol version mismatch: the frontend speaks version "
                            f"{PROTOCOL_VERSION + 1}, this "
                            f"process version {PROTOCOL_VERSION}; run the same roseserve release "
                            f"on both")


def test_a_frame_nested_too_deeply_is_dropped_and_the_pool_serves_on(pool_factory):
    """tools is free-form: 100,000 nested arrays in it made msgspec raise
    RecursionError out of the pool's receive loop, which stopped the pool."""
    from common.protocol import POOL_REQUESTS, Codec

    pool = pool_factory(workers=1)
    kind, _ = Codec(POOL_REQUESTS, {}).encode(TokenizeRequest(request_id="deep", prompt="x"))
    payload = (b"\x83\xaarequest_id\xa4deep\xa8messages\x91\x82\xa4role\xa4user\xa7content\xa2hi"
               b"\xa5tools\x91\x81\xa1a" + b"\x91" * 100_000 + b"\xc0")
    before, after, result = raw_frames_then_serve(pool.address, [[kind, payload]])
    assert after.num_frames_dropped - before.num_frames_dropped == 1
    assert len(result.prompt_token_ids) == 2


def test_a_tokenizer_the_workers_cannot_load_stops_the_pool_with_its_error(tmp_path,
                                                                          tiny_llama_dir):
    """The supervisor checks only tokenizer.json (the Rust tokenizer); what transformers
    refuses besides is found by the first worker, which logs it and stops the pool
    rather than being replaced again and again."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "tokenizer_config.json").write_text('{"bos_token": ')   # cut short
    pool = processes.tokenizer_pool(model, f"ipc://{tmp_path}/pool.sock", 2)
    try:
        assert pool.proc.wait(timeout=120) == 2
    finally:
        out = pool.stop()
    assert "cannot load the tokenizer from" in out and "Expecting value: line 1" in out, out
    assert "cannot load the tokenizer (its error is above): stopping the pool" in out
    assert "replacing it" not in out


def test_a_config_that_is_not_json_stops_the_pool_with_one_line(tmp_path, tiny_llama_dir):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "config.json").write_text("{not json")
    pool = processes.tokenizer_pool(model, f"ipc://{tmp_path}/pool.sock", 1)
    try:
        assert pool.proc.wait(timeout=120) == 2
    finally:
        out = pool.stop()
    assert f"cannot start the tokenizer pool: {model}/config.json is not a JSON object" in out
    assert "Traceback" not in out, out
