"""The async client of one engine worker, used by the frontend, benchmarks and tests.

Imports no torch: it speaks only the wire protocol (common/protocol.py).

One receive task reads the DEALER socket and dispatches each OutputBatch to the
per-request queues in one pass. Engine death is detected three ways, whichever comes
first: a DEAD frame; the connection dropping (a ZeroMQ socket-monitor event, which is
what a killed process produces); or no pong to the heartbeat within the deadline (a
hung engine). Any of them fails every in-flight request with EngineDeadError instead
of leaving it to hang, and new requests fail at once until the engine is back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from typing import AsyncIterator, Optional, Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, AbortRequests, AddRequest,
                             Codec, Dead, Hello, OutputBatch, Ping, Pong, ProtocolError, Ready,
                             RequestError, RequestErrorKind, RequestOutput, SamplingParams)
from common.sockets import make_socket

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine is gone (or unreachable); the request did not complete."""


class EngineRequestError(Exception):
    """The engine refused or failed one request."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.message = error.message
        self.kind = error.kind
        self.param = error.param


class EngineClient:
    def __init__(self, address: str, *, client_id: Optional[str] = None,
                 heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 10.0,
                 process=None) -> None:
        """``process``: the engine's Popen/Process handle when this side started it; its
        exit is then noticed directly."""
        self.address = address
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.process = process
        self.ctx = zmq.asyncio.Context()
        self.sock: Optional[zmq.asyncio.Socket] = None
        self.codec = Codec(ENGINE_MESSAGES)
        self.out_codec = Codec(CLIENT_MESSAGES)
        self.ready: Optional[Ready] = None
        self.dead_reason: Optional[str] = "not started"
        self.last_pong: Optional[Pong] = None
        self._last_pong_time = 0.0
        self._ready_event = asyncio.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._pings: dict[int, asyncio.Future] = {}
        self._nonces = itertools.count(1)
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -------------------------------------------------------------

    async def start(self, timeout_s: float = 120.0) -> Ready:
        """Connect and wait for the engine's Ready (it may still be loading)."""
        self.sock = make_socket(self.ctx, self.address, zmq.DEALER, bind=False,
                                identity=self.client_id.encode())
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.create_task(self._receive_loop(), name="engine-client-recv"),
                       asyncio.create_task(self._monitor_loop(monitor), name="engine-client-mon")]
        await self._send(Hello(client_id=self.client_id))
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise EngineDeadError(
                f"engine at {self.address} did not answer within {timeout_s:.0f} s") from None
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="engine-client-hb"))
        assert self.ready is not None
        return self.ready

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._fail_all("client closed")
        if self.sock is not None:
            self.sock.disable_monitor()
            self.sock.close(linger=0)
            self.sock = None
        self.ctx.term()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests --------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: Optional[SamplingParams] = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes. Leaving the loop
        early (or being cancelled) aborts the request in the engine."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            await self._send(AddRequest(request_id=request_id,
                                        prompt_token_ids=list(prompt_token_ids),
                                        params=params or SamplingParams()))
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished and self._streams.pop(request_id, None) is not None:
                await self.abort([request_id])

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        if self.dead_reason is None and request_ids:
            await self._send(AbortRequests(request_ids=list(request_ids)))

    async def ping(self, timeout_s: float = 5.0) -> Pong:
        """A round trip through the engine loop; raises EngineDeadError on timeout."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        nonce = next(self._nonces)
        future = asyncio.get_running_loop().create_future()
        self._pings[nonce] = future
        try:
            await self._send(Ping(nonce=nonce))
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"no pong within {timeout_s:.1f} s") from None
        finally:
            self._pings.pop(nonce, None)

    # -- internals -------------------------------------------------------------

    async def _send(self, message: msgspec.Struct) -> None:
        assert self.sock is not None
        await self.sock.send_multipart(self.out_codec.encode(message))

    async def _receive_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            try:
                message = self.codec.decode(frames)
            except ProtocolError as e:
                logger.warning("dropped a frame from the engine: %s", e)
                continue
            if isinstance(message, OutputBatch):
                streams = self._streams
                for out in message.outputs:
                    stream = streams.get(out.request_id)
                    if stream is not None:
                        stream.put_nowait(out)
                        if out.finish_reason is not None:
                            del streams[out.request_id]
            elif isinstance(message, RequestError):
                stream = self._streams.pop(message.request_id, None)
                if stream is not None:
                    stream.put_nowait(EngineRequestError(message))
            elif isinstance(message, Pong):
                self.last_pong = message
                self._last_pong_time = time.monotonic()
                future = self._pings.get(message.nonce)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, Ready):
                self._on_ready(message)
            elif isinstance(message, Dead):
                self._mark_dead(f"engine went down: {message.reason}")

    def _on_ready(self, ready: Ready) -> None:
        if self.ready is not None and ready.engine_id != self.ready.engine_id:
            # A new engine process: whatever the old one was running is lost.
            self._fail_all("the engine restarted")
        self.ready = ready
        self.dead_reason = None
        self._last_pong_time = time.monotonic()
        self._ready_event.set()

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self._mark_dead(f"lost the connection to the engine at {self.address}")
                elif event == zmq.EVENT_CONNECTED and self.ready is not None:
                    await self._send(Hello(client_id=self.client_id))  # reconnected
        finally:
            monitor.close(linger=0)

    async def _heartbeat_loop(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.heartbeat_interval_s)
            if time.monotonic() - before > self.heartbeat_interval_s + 1.0:
                # Our own event loop was stalled: the engine's pongs may be waiting
                # unread, so its silence is not evidence. Restart the clock.
                self._last_pong_time = time.monotonic()
            if self.process is not None and _exited(self.process):
                self._mark_dead("the engine process exited")
            elif self.dead_reason is None:
                silent = time.monotonic() - self._last_pong_time
                if silent > self.heartbeat_timeout_s:
                    self._mark_dead(f"the engine did not answer for {silent:.1f} s")
            if self.dead_reason is None:
                await self._send(Ping(nonce=next(self._nonces)))
            else:  # an engine that comes back answers with Ready, which revives us
                await self._send(Hello(client_id=self.client_id))

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:  # the first cause is the one worth reporting
            logger.error("%s; failing %d in-flight request(s)", reason, len(self._streams))
            self.dead_reason = reason
        self._fail_all(self.dead_reason)

    def _fail_all(self, reason: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put_nowait(EngineDeadError(reason))
        for future in self._pings.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))


def _exited(process) -> bool:
    poll = getattr(process, "poll", None)
    if poll is not None:  # subprocess.Popen
        return poll() is not None
    return not process.is_alive()  # multiprocessing.Process


__all__ = ["EngineClient", "EngineDeadError", "EngineRequestError", "RequestErrorKind"]
