"""The client side's socket, driven by the event loop (common/service_client.py):
frames that a full send queue does not take wait in order and all leave; a burst of
replies is read whole, even when handling one of them fails."""

from __future__ import annotations

import asyncio
import functools
import time

import zmq

from common import service_client
from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, AbortRequests, Codec, Hello,
                             OutputBatch, RequestOutput)
from common.sockets import make_socket
from engine_worker.client import EngineClient

SERVICE = Codec(ENGINE_MESSAGES, CLIENT_MESSAGES)


async def _read(router: zmq.Socket, count: int, timeout_s: float = 20.0) -> list:
    """``count`` messages from the fake service's ROUTER, read while the client's
    loop runs."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await asyncio.sleep(0.005)
            continue
        got.append((frames[0], SERVICE.decode(frames[1:])))
    return got


def test_frames_wait_in_order_while_the_service_does_not_read(tmp_path, monkeypatch):
    # Queues of 2 messages each way: 40 frames of ~100 KB outgrow them and the
    # kernel's buffers, so most wait in the client's backlog.
    monkeypatch.setattr(service_client, "make_socket", functools.partial(make_socket, hwm=2))
    address = f"ipc://{tmp_path}/service.sock"
    ctx = zmq.Context()
    router = make_socket(ctx, address, zmq.ROUTER, bind=True, hwm=2)

    async def main():
        client = EngineClient(address)
        await client.connect()
        filler = ["x" * 48] * 2000
        for n in range(40):
            client._send(AbortRequests(request_ids=[str(n), *filler]))
        backlog = len(client._backlog)
        got = await _read(router, 41)
        left = len(client._backlog)
        await client.close()
        return backlog, got, left

    try:
        backlog, got, left = asyncio.run(main())
    finally:
        router.close(linger=0)
        ctx.term()
    assert backlog > 20  # the queue filled: the frames waited here
    assert isinstance(got[0][1], Hello)
    assert [m.request_ids[0] for _, m in got[1:]] == [str(n) for n in range(40)]
    assert all(len(m.request_ids) == 2001 for _, m in got[1:])
    assert left == 0


def test_a_burst_of_replies_is_read_whole_when_handling_one_fails(tmp_path):
    address = f"ipc://{tmp_path}/service.sock"
    ctx = zmq.Context()
    router = make_socket(ctx, address, zmq.ROUTER, bind=True)

    class Failing(EngineClient):
        """Its handler fails on the first output batch."""

        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.handled: list[str] = []

        def _dispatch(self, message) -> None:
            self.handled.append(message.outputs[0].request_id)
            if len(self.handled) == 1:
                raise RuntimeError("a bug in a handler")

    async def main():
        client = Failing(address, heartbeat_interval_s=60)  # nothing else looks
        await client.connect()
        [(identity, hello)] = await _read(router, 1)
        assert isinstance(hello, Hello)
        for n in range(5):
            out = OutputBatch(outputs=[RequestOutput(request_id=f"r{n}", new_token_ids=[n])])
            router.send_multipart([identity, *SERVICE.encode(out)])
        time.sleep(0.5)  # the loop blocked: all five arrive as one burst, signalled once
        deadline = time.monotonic() + 10
        while len(client.handled) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await client.close()
        return client.handled

    try:
        handled = asyncio.run(main())
    finally:
        router.close(linger=0)
        ctx.term()
    assert handled == [f"r{n}" for n in range(5)]



def test_hellos_to_an_address_where_nothing_answers_grow_rarer(tmp_path):
    """Until its service answers, a client says Hello at a heartbeat, then at twice the
    last interval: ZeroMQ keeps them all and delivers them at once when a service binds
    the address (one a heartbeat, a day's outage, was 86,400 Hellos at once)."""
    address = f"ipc://{tmp_path}/service.sock"

    async def main():
        client = EngineClient(address, heartbeat_interval_s=0.1)
        await client.connect()
        await asyncio.sleep(3.2)   # Hellos at about 0, 0.1, 0.3, 0.7, 1.5 and 3.1 s
        ctx = zmq.Context()
        router = make_socket(ctx, address, zmq.ROUTER, bind=True)
        try:
            got = await _read(router, 100, timeout_s=1.0)
        finally:
            await client.close()
            router.close(linger=0)
            ctx.term()
        return got

    got = asyncio.run(main())
    assert all(isinstance(m, Hello) for _, m in got)
    assert 4 <= len(got) <= 8, len(got)   # 33 at one a heartbeat
