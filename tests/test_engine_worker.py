"""The engine worker process, driven over its real ZeroMQ socket."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, AddRequest, Codec,
                             FinishReason, Hello)
from engine_worker.client import EngineClient, EngineDeadError, EngineRequestError
import processes
from helpers import greedy, make_engine, random_prompts

PROMPTS = random_prompts([3, 11, 26, 40], seed=21)


@pytest.fixture
def engine_factory(tmp_path, tiny_llama_dir):
    procs = []

    def start(*extra: str, name: str = "engine") -> EngineProcess:
        proc = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/{name}.sock", *extra)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory, tiny_llama_dir):
    path = tmp_path_factory.mktemp("shared-engine")
    proc = processes.engine(tiny_llama_dir, f"ipc://{path}/engine.sock")
    yield proc
    proc.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def connect(address: str, **kw) -> EngineClient:
    client = EngineClient(address, **kw)
    await client.start(timeout_s=60)
    return client


async def collect(client: EngineClient, request_id: str, prompt, params):
    outs = []
    async for out in client.generate(request_id, prompt, params):
        outs.append(out)
    return outs


def token_ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_outputs_equal_the_in_process_engine(shared_engine, tiny_llama_dir):
    expected = make_engine(tiny_llama_dir).generate(PROMPTS, greedy(10))

    async def main():
        client = await connect(shared_engine.address)
        assert client.ready.vocab_size == 50257 and client.ready.max_model_len == 512
        results = await asyncio.gather(*[collect(client, f"p{i}", p, greedy(10))
                                         for i, p in enumerate(PROMPTS)])
        await client.close()
        return results

    results = run(main())
    assert [token_ids(outs) for outs in results] == expected
    for outs in results:
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert outs[0].queue_ms is not None and outs[0].prefill_ms is not None


def test_abort_mid_generation_frees_blocks(shared_engine):
    async def main():
        client = await connect(shared_engine.address)
        seen = 0
        async for out in client.generate("long", PROMPTS[3], greedy(400)):
            seen += len(out.new_token_ids)
            if seen == 5:
                break  # leaving the stream aborts the request
        for _ in range(50):
            stats = (await client.ping()).stats
            if stats.num_running == 0:
                break
            await asyncio.sleep(0.05)
        await client.close()
        return stats

    stats = run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_blocks_used == 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_two_clients_at_once_get_their_own_outputs(shared_engine, tiny_llama_dir):
    expected = make_engine(tiny_llama_dir).generate(PROMPTS[:2], greedy(8))

    async def main():
        a, b = await connect(shared_engine.address), await connect(shared_engine.address)
        # The same request id from two clients: each gets its own stream.
        ra, rb = await asyncio.gather(collect(a, "same-id", PROMPTS[0], greedy(8)),
                                      collect(b, "same-id-b", PROMPTS[1], greedy(8)))
        await a.close()
        await b.close()
        return ra, rb

    ra, rb = run(main())
    assert [token_ids(ra), token_ids(rb)] == expected


def test_invalid_request_gets_an_error_with_its_param(shared_engine):
    async def main():
        client = await connect(shared_engine.address)
        with pytest.raises(EngineRequestError) as info:
            await collect(client, "bad", [1, 999999], greedy(3))
        ok = await collect(client, "good", [1, 2], greedy(3))
        await client.close()
        return info.value, ok

    error, ok = run(main())
    assert error.param == "prompt" and "outside the vocabulary" in error.message
    assert len(token_ids(ok)) == 3


def test_garbage_frames_do_not_kill_it(shared_engine):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(shared_engine.address)
    for frames in ([b"junk"], [b"\x02", b"\xc1"], [b"\x63", b"\x80"], [b"\x02", b"\x81\xa1x\x01"],
                   [b"", b"", b""], [b"\x02", msgpack.packb({"request_id": 5})]):
        sock.send_multipart(frames)
    # A well-formed request on the same socket still works, and the reply is plain
    # msgpack any decoder reads.
    codec = Codec(CLIENT_MESSAGES, ENGINE_MESSAGES)
    sock.send_multipart(codec.encode(Hello(client_id="raw")))
    sock.send_multipart(codec.encode(AddRequest(request_id="raw-1", prompt_token_ids=[5, 6],
                                                params=greedy(2))))
    seen = []
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(len(o["new_token_ids"]) for o in seen) < 2:
        if poller.poll(1000):
            kind, payload = sock.recv_multipart()
            message = msgpack.unpackb(payload)
            if kind == b"\x11":  # OUTPUTS
                seen.extend(message["outputs"])
    sock.close(0)
    ctx.term()
    assert [o["request_id"] for o in seen] == ["raw-1", "raw-1"]
    assert seen[-1]["finish_reason"] == "stop" or seen[-1]["finish_reason"] == "length"
    assert shared_engine.proc.poll() is None


def test_killing_the_engine_fails_in_flight_requests_quickly(engine_factory):
    engine = engine_factory()

    async def main():
        client = await connect(engine.address, heartbeat_timeout_s=30)
        started = asyncio.Event()

        async def consume():
            async for _ in client.generate("victim", PROMPTS[1], greedy(5000 // 10)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        engine.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            await task
        elapsed = time.monotonic() - t0
        with pytest.raises(EngineDeadError):
            await collect(client, "after", PROMPTS[0], greedy(2))
        await client.close()
        return elapsed

    assert run(main()) < 3.0


def test_sigterm_lets_in_flight_requests_complete(engine_factory):
    engine = engine_factory("--drain-timeout", "60")

    async def main():
        client = await connect(engine.address)
        first = asyncio.Event()
        outputs = []

        async def consume(i):
            async for out in client.generate(f"d{i}", PROMPTS[i], greedy(60)):
                outputs.append(out)
                first.set()

        tasks = [asyncio.create_task(consume(i)) for i in range(3)]
        await first.wait()
        engine.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        # Draining: new work is refused, with a reason.
        with pytest.raises(EngineRequestError, match="shutting down"):
            await collect(client, "late", PROMPTS[0], greedy(2))
        await asyncio.gather(*tasks)
        # Then the engine says it is going down.
        for _ in range(100):
            if not client.healthy:
                break
            await asyncio.sleep(0.05)
        reason = client.dead_reason
        await client.close()
        return outputs, reason

    outputs, reason = run(main())
    finished = [o for o in outputs if o.finish_reason is not None]
    assert sorted(o.request_id for o in finished) == ["d0", "d1", "d2"]
    assert all(o.finish_reason is FinishReason.LENGTH for o in finished)
    assert sum(len(o.new_token_ids) for o in outputs) == 180
    assert reason is not None and "engine stopped" in reason
    assert engine.proc.wait(timeout=30) == 0


def test_second_signal_aborts_at_once(engine_factory):
    engine = engine_factory("--drain-timeout", "600")

    async def main():
        client = await connect(engine.address)
        first = asyncio.Event()
        last = []

        async def consume():
            async for out in client.generate("slow", PROMPTS[2], greedy(480)):
                last.append(out)
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        engine.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        engine.proc.send_signal(signal.SIGTERM)
        await task
        await client.close()
        return last[-1]

    final = run(main())
    assert final.finish_reason is FinishReason.ABORT
    assert "shutting down" in final.error
    assert engine.proc.wait(timeout=30) == 0


def test_a_vanished_client_has_its_requests_aborted(engine_factory):
    engine = engine_factory("--client-timeout", "1")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"ghost")
    sock.connect(engine.address)
    codec = Codec(CLIENT_MESSAGES, ENGINE_MESSAGES)
    sock.send_multipart(codec.encode(AddRequest(request_id="orphan", prompt_token_ids=[1, 2, 3],
                                                params=greedy(480))))
    time.sleep(0.5)
    sock.close(0)  # gone without a word
    ctx.term()

    async def main():
        client = await connect(engine.address)
        for _ in range(100):
            stats = (await client.ping()).stats
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.1)
        await client.close()
        return stats

    stats = run(main())
    assert stats.num_running == 0 and stats.num_blocks_used == 0


def test_binding_beyond_loopback_is_only_done_when_asked():
    from common.sockets import is_loopback

    assert is_loopback("tcp://127.0.0.1:5557") and is_loopback("ipc:///tmp/x.sock")
    assert is_loopback("tcp://localhost:1") and is_loopback("tcp://[::1]:1")
    assert not is_loopback("tcp://0.0.0.0:5557") and not is_loopback("tcp://10.0.0.5:1")
    from common.config import EngineServerConfig

    assert is_loopback(EngineServerConfig().bind)


def test_unsupported_model_exits_with_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["T5ForConditionalGeneration"]}')
    proc = subprocess.run([sys.executable, "-m", "engine_worker", "--model", str(tmp_path),
                           "--device", "cpu", "--bind", f"ipc://{tmp_path}/e.sock"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unsupported architecture ['T5ForConditionalGeneration']" in proc.stderr
