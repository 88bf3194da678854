"""The engine worker process, driven over its real ZeroMQ socket."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from common.protocol import CLIENT_MESSAGES, ENGINE_MESSAGES, AddRequest, Codec, FinishReason
from engine_worker.client import EngineDeadError, EngineRequestError
from engine_worker_helpers import PROMPTS, collect, connect, run, token_ids, wait_idle
from helpers import greedy, make_engine


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


def test_run_ahead_serves_the_same_tokens_over_zeromq(engine_factory, tiny_llama_dir):
    """--async-scheduling (on by default with CUDA only) forced on for the CPU engine:
    the engine process's outputs are still the in-process engine's, token for token."""
    expected = make_engine(tiny_llama_dir).generate(PROMPTS, greedy(10))
    proc = engine_factory("--async-scheduling")

    async def main():
        client = await connect(proc.address)
        results = await asyncio.gather(*[collect(client, f"a{i}", p, greedy(10))
                                         for i, p in enumerate(PROMPTS)])
        stats = await wait_idle(client)
        await client.close()
        return results, stats

    results, stats = run(main())
    assert [token_ids(outs) for outs in results] == expected
    assert all(outs[-1].finish_reason is FinishReason.LENGTH for outs in results)
    assert stats.num_blocks_used == 0


def test_abort_mid_generation_stops_it_and_frees_blocks(slow_engine):
    async def main():
        client = await connect(slow_engine.address)
        before = (await client.ping()).stats.num_generated_tokens
        seen = 0
        async for out in client.generate("long", PROMPTS[3], greedy(400)):
            seen += len(out.new_token_ids)
            if seen == 5:
                break  # leaving the stream aborts the request
        stats = await wait_idle(client)
        await client.close()
        return stats, stats.num_generated_tokens - before

    stats, generated = run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert generated < 30  # 5 read, a few more in flight; never the 400 asked for
    assert stats.num_blocks_used == 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_a_client_that_stalled_past_its_timeout_is_told_its_requests_ended(engine_factory):
    """The client's event loop blocks for 2.5 s (no heartbeat) while the engine's client
    timeout is 1 s: the engine aborts its request, and once the client is back the
    stream ends with the reason instead of staying open forever. 20 ms a step: the
    request is still running when the engine gives up on the client."""
    engine = engine_factory("--client-timeout", "1", env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02"})

    async def main():
        client = await connect(engine.address)
        outs = []

        async def consume():
            async for out in client.generate("stalled", PROMPTS[1], greedy(480)):
                outs.append(out)
                if len(outs) == 2:
                    time.sleep(2.5)  # the whole loop stalls, heartbeats included
        await asyncio.wait_for(consume(), 30)
        await client.close()
        return outs

    outs = run(main())
    assert outs[-1].finish_reason is FinishReason.ABORT
    assert outs[-1].error.startswith("aborted by the engine: it heard nothing from this client")
    assert len(token_ids(outs)) < 480


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
        all_running = asyncio.Event()
        outputs = []

        async def consume(i):
            async for out in client.generate(f"d{i}", PROMPTS[i], greedy(60)):
                outputs.append(out)
                if len({o.request_id for o in outputs}) == 3:
                    all_running.set()

        tasks = [asyncio.create_task(consume(i)) for i in range(3)]
        await all_running.wait()
        engine.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        # Draining: the client was told (routers send it nothing more) ...
        assert client.draining and client.healthy and not client.accepting
        # ... and new work is refused, with a reason.
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


@pytest.mark.parametrize("interval", [1, 1000])
def test_second_signal_aborts_at_once(engine_factory, tiny_llama_dir, interval):
    """With an output interval longer than the request ran, every token after the
    first is still held back when the abort comes: it brings them."""
    # 480 steps of at least 5 ms: still generating when the second signal lands, a
    # second after the first (long enough for more than 10 steps on a machine whose
    # cores are shared: 0.2 s gave 4 there).
    engine = engine_factory("--drain-timeout", "600",
                            env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.005"})

    async def main():
        client = await connect(engine.address)
        first = asyncio.Event()
        last = []

        async def consume():
            async for out in client.generate("slow", PROMPTS[2], greedy(480),
                                             output_interval=interval):
                last.append(out)
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        engine.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        engine.proc.send_signal(signal.SIGTERM)
        await task
        await client.close()
        return last

    outs = run(main())
    final = outs[-1]
    assert final.finish_reason is FinishReason.ABORT
    assert "shutting down" in final.error
    assert engine.proc.wait(timeout=30) == 0
    tokens = token_ids(outs)
    assert tokens == make_engine(tiny_llama_dir).generate([PROMPTS[2]], greedy(len(tokens)))[0]
    if interval > 1:
        assert len(outs) == 2 and len(final.new_token_ids) == len(tokens) - 1 > 10


def test_an_output_interval_sends_tokens_a_few_at_a_time(shared_engine, tiny_llama_dir):
    """AddRequest.output_interval 3: the first output at once (with the prompt's
    figures), then 3 tokens an output, the last one with what is left; the same tokens
    and logprobs as one token an output."""
    params = msgspec.structs.replace(greedy(10), logprobs=2)
    expected = make_engine(tiny_llama_dir).generate(PROMPTS[:2], greedy(10))

    async def main():
        client = await connect(shared_engine.address)
        results = []
        for max_tokens in (10, 9):
            p = msgspec.structs.replace(params, max_tokens=max_tokens)
            results.append(await asyncio.gather(
                collect(client, f"i{max_tokens}", PROMPTS[0], p, output_interval=3),
                collect(client, f"o{max_tokens}", PROMPTS[1], p)))
        await client.close()
        return results

    (ten, plain), (nine, _) = run(main())
    assert [len(o.new_token_ids) for o in ten] == [1, 3, 3, 3]
    assert [len(o.new_token_ids) for o in nine] == [1, 3, 3, 2]
    assert [len(o.new_token_ids) for o in plain] == [1] * 10
    assert token_ids(ten) == expected[0] and token_ids(nine) == expected[0][:9]
    assert token_ids(plain) == expected[1]
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in ten + nine)
    assert ten[0].queue_ms is not None and ten[0].num_cached_tokens is not None
    assert ten[-1].finish_reason is FinishReason.LENGTH
    assert all(o.finish_reason is None for o in ten[:-1])


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


def test_pings_are_answered_during_a_step_longer_than_the_heartbeat_timeout(engine_factory):
    engine = engine_factory(env={"ROSESERVE_FAULT_STEP_DELAY_S": "1.5"})

    async def main():
        client = await connect(engine.address, heartbeat_interval_s=0.2,
                               heartbeat_timeout_s=0.6)
        task = asyncio.create_task(collect(client, "slow", PROMPTS[0], greedy(2)))
        await asyncio.sleep(0.8)  # inside the first 1.5 s step
        pong = await client.ping(timeout_s=0.5)
        outs = await task
        healthy = client.healthy
        await client.close()
        return pong, outs, healthy

    pong, outs, healthy = run(main())
    assert pong.busy_s > 0.5  # answered while the step ran
    assert len(token_ids(outs)) == 2 and healthy


def test_a_client_that_gave_up_during_a_stall_has_its_requests_aborted(engine_factory):
    """The loop hangs for 3 s inside step 5; the client gives up on the engine after
    0.5 s, failing its request. When the loop is back, the client's Hello lists
    nothing, so the engine stops the request instead of running it to 400 tokens."""
    engine = engine_factory(env={"ROSESERVE_FAULT_STALL": "5:3"})

    async def main():
        client = await connect(engine.address, heartbeat_interval_s=0.2, stall_timeout_s=0.5)
        with pytest.raises(EngineDeadError, match="stuck in one iteration"):
            await collect(client, "victim", PROMPTS[1], greedy(400))
        for _ in range(100):  # revived by the Ready that answers its Hello
            if client.healthy:
                break
            await asyncio.sleep(0.1)
        revived = client.healthy
        stats = await wait_idle(client)
        after = await collect(client, "after", PROMPTS[0], greedy(3))
        await client.close()
        return revived, stats, after

    revived, stats, after = run(main())
    assert revived
    assert stats.num_running == 0 and stats.num_blocks_used == 0
    assert stats.num_generated_tokens < 30  # not the 400 the victim asked for
    assert len(token_ids(after)) == 3


def test_a_request_that_fails_in_the_engine_fails_alone(engine_factory, tiny_llama_dir):
    engine = engine_factory(env={"ROSESERVE_FAULT_FAIL_TOKEN": "4242"})
    expected = make_engine(tiny_llama_dir).generate(PROMPTS[:2], greedy(8))

    async def main():
        client = await connect(engine.address)
        results = await asyncio.gather(
            collect(client, "a", PROMPTS[0], greedy(8)),
            collect(client, "bad", [4242, *PROMPTS[2]], greedy(8)),
            collect(client, "b", PROMPTS[1], greedy(8)))
        stats = await wait_idle(client)
        await client.close()
        return results, stats

    (a, bad, b), stats = run(main())
    assert [token_ids(a), token_ids(b)] == expected
    assert len(token_ids(bad)) == 2 and bad[-1].finish_reason is FinishReason.ERROR
    assert "injected per-request failure" in bad[-1].error
    assert stats.num_blocks_used == 0


def test_a_sticky_cuda_error_ends_the_engine_process(engine_factory):
    engine = engine_factory(env={"ROSESERVE_FAULT_CUDA_ERROR_TOKEN": "4243"})

    async def main():
        client = await connect(engine.address)
        try:
            with pytest.raises(EngineDeadError, match="fatal CUDA error"):
                await asyncio.wait_for(collect(client, "bad", [4243, *PROMPTS[0]], greedy(4)), 30)
        finally:
            await client.close()

    run(main())
    assert engine.proc.wait(timeout=30) == 1
    assert "fatal CUDA error, the engine cannot continue" in engine.stop()


def test_the_signal_handler_takes_no_lock(tmp_path, tiny_llama_dir):
    """A signal lands in the main thread between two bytecodes of whatever runs
    there, e.g. inside inbox.get() holding the queue's lock: a handler that took that
    lock would wait on itself forever."""
    import threading

    from common.config import EngineServerConfig
    from engine_worker.server import EngineServer

    server = EngineServer(make_engine(tiny_llama_dir, num_blocks=16),
                          EngineServerConfig(bind=f"ipc://{tmp_path}/sig.sock"))
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        server._install_signal_handlers()
        handler = signal.getsignal(signal.SIGTERM)
        done = threading.Event()

        def interrupted_while_holding_the_inbox_lock():
            with server.inbox.mutex:
                handler(signal.SIGTERM, None)
            done.set()

        threading.Thread(target=interrupted_while_holding_the_inbox_lock, daemon=True).start()
        assert done.wait(5), "the signal handler blocked on a lock"
        assert server.num_signals == 1
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
        server.io.start()
        server._close()


def test_a_receiver_that_raises_loses_only_its_own_request(shared_engine):
    """EngineClient.submit hands outputs to a sink from the receive loop: a sink that
    raises is dropped (its request aborted), and the loop serves everyone else."""
    def broken(_item):
        raise RuntimeError("a bug in the receiver")

    async def main():
        client = await connect(shared_engine.address)
        client.submit("broken", PROMPTS[0], greedy(50), broken)
        good = await collect(client, "good", PROMPTS[1], greedy(5))
        stats = await wait_idle(client)
        await client.close()
        return good, stats

    good, stats = run(main())
    assert len(token_ids(good)) == 5 and good[-1].finish_reason is FinishReason.LENGTH
    assert stats.num_running == 0 and stats.num_blocks_used == 0


def test_an_abort_right_behind_its_add_is_not_lost(slow_engine):
    """The loop batches adds before a step; an abort read in the same batch as its
    add (the engine busy in a 20 ms step) must still find the request."""
    async def main():
        client = await connect(slow_engine.address)
        outputs: asyncio.Queue = asyncio.Queue()
        client.submit("busy", PROMPTS[0], greedy(200), outputs.put_nowait)
        await outputs.get()  # the engine is stepping
        for i in range(5):
            client.submit(f"gone-{i}", PROMPTS[1], greedy(200), lambda item: None)
            client.cancel([f"gone-{i}"])
        await asyncio.sleep(0.5)
        stats = (await client.ping()).stats
        client.cancel(["busy"])
        await client.close()
        return stats

    stats = run(main())
    assert stats.num_running + stats.num_waiting == 1  # "busy" alone


def test_hellos_sent_before_the_engine_was_up_are_all_answered_and_logged_once(
        tmp_path, engine_factory):
    """A client says Hello every heartbeat until answered; those it sent while the
    engine was loading arrive together. Each gets its Ready (the client may wait on
    any of them); the engine logs the client's arrival once."""
    from common.protocol import PROTOCOL_VERSION, Hello, Ready
    from engine_worker_helpers import RawClient

    address = f"ipc://{tmp_path}/engine.sock"
    client = RawClient(address, b"early")   # connects before anything is bound
    try:
        for _ in range(3):
            client.send(Hello(client_id="early", protocol_version=PROTOCOL_VERSION))
        engine = engine_factory()
        assert engine.address == address
        seen = []
        readies = client.receive(120, until=lambda m: isinstance(m, Ready) and (
            seen.append(m) or len(seen) == 3))
    finally:
        client.close()
    assert len([m for m in readies if isinstance(m, Ready)]) == 3
    assert engine.output().count("client early connected") == 1
