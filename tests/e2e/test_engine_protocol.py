"""The engine worker's protocol, spoken by hand on raw sockets (a client library
would hide what is tested: whose outputs reach whom, what a malformed or foreign frame
gets)."""

from __future__ import annotations

import asyncio
import signal
import time

import msgpack
import pytest
import zmq

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, PROTOCOL_VERSION, AbortRequests,
                             AddRequest, Codec, Dead, FinishReason, Hello, Ping, Pong, Ready,
                             RequestError)
from engine_worker.client import EngineClient, EngineDeadError
from engine_worker_helpers import PROMPTS, RawClient, run, token_ids
from helpers import greedy, make_engine


def test_two_clients_at_once_get_only_their_own_outputs(shared_engine, tiny_llama_dir):
    """Read on raw sockets: a client library drops outputs of ids it does not follow,
    which would hide an engine that sent every output to every client."""
    expected = make_engine(tiny_llama_dir).generate(PROMPTS[:2], greedy(8))
    a = RawClient(shared_engine.address, b"client-a")
    b = RawClient(shared_engine.address, b"client-b")
    try:
        a.hello()
        b.hello()
        a.send(AddRequest(request_id="from-a", prompt_token_ids=PROMPTS[0], params=greedy(8)))
        b.send(AddRequest(request_id="from-b", prompt_token_ids=PROMPTS[1], params=greedy(8)))
        got_a, got_b = a.until_finished("from-a"), b.until_finished("from-b")
        got_a += a.outputs(0.5)  # anything else sent to a
    finally:
        a.close()
        b.close()
    assert {o.request_id for o in got_a} == {"from-a"}
    assert {o.request_id for o in got_b} == {"from-b"}
    assert [token_ids(got_a), token_ids(got_b)] == expected


def test_an_id_in_use_is_refused_even_from_another_client(slow_engine):
    a = RawClient(slow_engine.address, b"first")  # 20 ms a step: still running when b asks
    b = RawClient(slow_engine.address, b"second")
    try:
        a.hello()
        b.hello()
        a.send(AddRequest(request_id="shared-id", prompt_token_ids=PROMPTS[0],
                          params=greedy(400)))
        a.receive(0.3)
        b.send(AddRequest(request_id="shared-id", prompt_token_ids=PROMPTS[1], params=greedy(2)))
        errors = [m for m in b.receive(5, until=lambda m: isinstance(m, RequestError))
                  if isinstance(m, RequestError)]
        a.send(AbortRequests(request_ids=["shared-id"]))
        first = a.outputs(1.0)
        assert a.stats().num_running == 0
    finally:
        a.close()
        b.close()
    assert [e.message for e in errors] == ["request_id 'shared-id' is already in use"]
    # The first client's request ran on undisturbed until it aborted it.
    assert first and all(o.error is None for o in first)


def test_a_client_of_another_protocol_version_is_refused(shared_engine):
    raw = RawClient(shared_engine.address, b"old-frontend")
    try:
        raw.send(Hello(client_id="old-frontend"))  # no version: an older release
        replies = raw.receive(120, until=lambda m: isinstance(m, (Dead, Ready)))
    finally:
        raw.close()
    assert isinstance(replies[-1], Dead)
    assert replies[-1].reason == (
        f"protocol version mismatch: the client speaks version 0, this process version "
        f"{PROTOCOL_VERSION}; run the same roseserve release on both")


def test_an_engine_of_another_protocol_version_is_refused(tmp_path):
    """A fake engine answering Hello with a Ready of version 0: start() fails at once,
    naming both versions."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    address = f"ipc://{tmp_path}/old-engine.sock"
    router.bind(address)
    codec = Codec(ENGINE_MESSAGES, CLIENT_MESSAGES)
    ready = Ready(engine_id="old", model_name="m", max_model_len=8, vocab_size=8,
                  num_kv_blocks=1, block_size=1, eos_token_ids=[])

    async def main():
        client = EngineClient(address)
        start = asyncio.create_task(client.start(timeout_s=30))
        identity, *frames = await asyncio.to_thread(router.recv_multipart)
        assert isinstance(codec.decode(frames), Hello)
        router.send_multipart([identity, *codec.encode(ready)])
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            await start
        return str(info.value), time.monotonic() - t0

    try:
        message, waited = run(main())
    finally:
        router.close(0)
        ctx.term()
    assert message == (f"protocol version mismatch: the engine speaks version 0, this process "
                       f"version {PROTOCOL_VERSION}; run the same roseserve release on both")
    assert waited < 5


def test_an_undecodable_request_gets_an_error_instead_of_silence(shared_engine):
    raw = RawClient(shared_engine.address, b"sloppy")
    try:
        raw.hello()
        raw.sock.send_multipart([b"\x02", msgpack.packb({
            "request_id": "bad-params", "prompt_token_ids": [1, 2],
            "params": {"max_tokens": "many"}})])
        replies = raw.receive(3, until=lambda m: isinstance(m, RequestError))
    finally:
        raw.close()
    assert replies and replies[-1].request_id == "bad-params"
    assert replies[-1].message.startswith("undecodable request: bad AddRequest payload")
    assert "max_tokens" in replies[-1].message


def test_hello_reconciles_the_requests_a_client_follows(slow_engine):
    raw = RawClient(slow_engine.address, b"reconciler")
    try:
        raw.hello()
        for name in ("keep", "drop"):
            raw.send(AddRequest(request_id=name, prompt_token_ids=PROMPTS[0], params=greedy(400)))
        raw.receive(1.0)
        assert raw.stats().num_running == 2
        raw.send(Hello(client_id="reconciler", request_ids=["keep"],
                       protocol_version=PROTOCOL_VERSION))
        ended = [o for m in raw.receive(0.5) if hasattr(m, "outputs") for o in m.outputs
                 if o.request_id == "drop" and o.finish_reason is not None]
        # "drop" was aborted, and said so; "keep" goes on.
        assert [(o.finish_reason, o.error) for o in ended] == [
            (FinishReason.ABORT, "the client no longer follows this request")]
        assert raw.stats().num_running == 1
        assert {o.request_id for o in raw.outputs(0.5)} == {"keep"}
        raw.send(AbortRequests(request_ids=["keep"]))
        raw.receive(0.5)
        assert raw.stats().num_running == 0
    finally:
        raw.close()


def test_bad_frames_are_counted_and_an_oversized_one_costs_only_its_connection(
        engine_factory):
    engine = engine_factory("--max-frame-bytes", "4096")
    raw = RawClient(engine.address, b"fuzzer")
    other = RawClient(engine.address, b"bystander")
    try:
        other.hello()  # the engine has loaded (a Ping alone waits only 5 s)
        before = other.stats()
        for frames in ([b"junk"], [b"\x02", b"\xc1"], [b"\x63", b"\x80"],
                       [b"\x02", b"\x81\xa1x\x01"], [b"", b"", b""],
                       [b"\x02", msgpack.packb({"request_id": 5})],
                       [b"\x02", msgpack.packb({"request_id": "t", "prompt_token_ids": [1, 2],
                                                 "params": {"max_tokens": "many"}})],
                       [b"\x02", AddRequest(request_id="t", prompt_token_ids=[1] * 50,
                                             params=greedy(2)).__class__.__name__.encode()]):
            raw.sock.send_multipart(frames)
        raw.sock.send_multipart([b"\x02", b"\x00" * 10_000])  # over the 4096-byte limit
        time.sleep(1.0)
        stats = other.stats()
        assert stats.num_frames_dropped - before.num_frames_dropped == 8
        assert stats.num_disconnects - before.num_disconnects >= 1
        # The fuzzer's connection comes back by itself and works; so does the other's.
        # The DEALER reconnects on its own timer; a Hello sent before it has is resent.
        for _ in range(30):
            raw.send(Hello(client_id="fuzzer", protocol_version=PROTOCOL_VERSION))
            if any(isinstance(m, Ready)
                   for m in raw.receive(1.0, until=lambda m: isinstance(m, Ready))):
                break
        raw.send(AddRequest(request_id="after", prompt_token_ids=[5, 6], params=greedy(2)))
        other.send(AddRequest(request_id="other", prompt_token_ids=[7, 8], params=greedy(2)))
        assert len(token_ids(raw.until_finished("after", 30))) == 2
        assert len(token_ids(other.until_finished("other", 30))) == 2
        assert engine.proc.poll() is None
    finally:
        raw.close()
        other.close()


def test_a_drain_is_announced_to_every_client_at_once(engine_factory):
    """On SIGTERM every client gets an unsolicited Pong (nonce 0) saying the engine
    drains, before any heartbeat asks; a pong it then asks for says so too."""
    engine = engine_factory(env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02"})
    raw = RawClient(engine.address, b"watcher")
    try:
        raw.hello()
        raw.send(AddRequest(request_id="long", prompt_token_ids=[5, 6], params=greedy(100)))
        assert raw.outputs(0.5)  # running
        assert raw.stats().num_running == 1
        engine.proc.send_signal(signal.SIGTERM)
        pong = [m for m in raw.receive(5, until=lambda m: isinstance(m, Pong))
                if isinstance(m, Pong)]
        assert [(p.nonce, p.draining) for p in pong] == [(0, True)]
        raw.send(Ping(nonce=7))
        asked = [m for m in raw.receive(5, until=lambda m: isinstance(m, Pong))
                 if isinstance(m, Pong)]
        assert [(p.nonce, p.draining) for p in asked] == [(7, True)]
        # The request it runs finishes in full.
        assert raw.until_finished("long", 30)[-1].finish_reason is FinishReason.LENGTH
        assert engine.proc.wait(timeout=30) == 0
    finally:
        raw.close()
