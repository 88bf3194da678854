"""Helpers of the engine worker's process tests (test_engine_worker.py,
test_engine_protocol.py): prompts, an async client's round trips, and RawClient, a
DEALER socket speaking the protocol by hand."""

from __future__ import annotations

import asyncio
import time

import zmq

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, PROTOCOL_VERSION, Codec, Hello,
                             Ping, Ready)
from engine_worker.client import EngineClient
from helpers import random_prompts

PROMPTS = random_prompts([3, 11, 26, 40], seed=21)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def connect(address: str, **kw) -> EngineClient:
    client = EngineClient(address, **kw)
    await client.start(timeout_s=60)
    return client


async def collect(client: EngineClient, request_id: str, prompt, params, **extra):
    outs = []
    async for out in client.generate(request_id, prompt, params, **extra):
        outs.append(out)
    return outs


def token_ids(outs):
    return [t for o in outs for t in o.new_token_ids]


async def wait_idle(client: EngineClient, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await client.ping()).stats
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


class RawClient:
    """A DEALER speaking the protocol by hand."""

    def __init__(self, address: str, identity: bytes) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.codec = Codec(CLIENT_MESSAGES, ENGINE_MESSAGES)

    def send(self, message) -> None:
        self.sock.send_multipart(self.codec.encode(message))

    def receive(self, seconds: float, until=None) -> list:
        """Messages arriving within ``seconds``; stops early at one ``until`` accepts."""
        out = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000)):
            out.append(self.codec.decode(self.sock.recv_multipart()))
            if until is not None and until(out[-1]):
                break
        return out

    def outputs(self, seconds: float) -> list:
        return [o for m in self.receive(seconds) if hasattr(m, "outputs") for o in m.outputs]

    def hello(self, seconds: float = 120) -> None:
        """Say Hello and wait for Ready (the engine may still be loading)."""
        self.send(Hello(client_id=self.sock.getsockopt(zmq.IDENTITY).decode(),
                        protocol_version=PROTOCOL_VERSION))
        assert isinstance(self.receive(seconds, until=lambda m: isinstance(m, Ready))[-1], Ready)

    def until_finished(self, request_id: str, seconds: float = 60) -> list:
        """Outputs until request_id's last one."""
        outs = []
        for m in self.receive(seconds, until=lambda m: any(
                o.request_id == request_id and o.finish_reason is not None
                for o in getattr(m, "outputs", []))):
            outs += getattr(m, "outputs", [])
        return outs

    def stats(self):
        self.send(Ping(nonce=1))
        return self.receive(5, until=lambda m: hasattr(m, "stats"))[-1].stats

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
