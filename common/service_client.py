"""The async client side of a roseserve service (an engine worker, the tokenizer pool).

What every such client does: connect a DEALER socket, say Hello, read replies as the
event loop sees them arrive and hand them to the subclass, and keep checking that the
service is alive. The service may come later or go and come back: until its Ready
arrives the client is unavailable (new work fails at once) and says Hello again, at a
heartbeat, then less and less often (ZeroMQ keeps what is sent to an address where
nothing answers and delivers it all once something does: a Hello every second for a
day would have been 86,400 Hellos, and as many Readies, at once).

Death is detected four ways, whichever comes first: a DEAD frame; the connection
dropping or refused at the handshake (ZeroMQ socket-monitor events: a killed process;
a service that does not hold this client's CURVE key, common/curve.py); no
pong to the heartbeat within the deadline (a hung process or a lost network; pongs
come from the service's I/O thread, so a long step never delays them); or a pong
saying the service's loop has been in one iteration for longer than ``stall_timeout_s`` (a
hung loop). Any of them fails everything in flight (``_fail_pending``) instead of
leaving it to hang. A Ready revives the client; the Hello that asked for it listed the
work the client still follows, so the service drops whatever the client gave up on
(reconciliation), and a Ready from a different instance means the old one's work is
lost. A service that drains (an engine after SIGTERM) says so in its pongs: it stays
healthy, finishing its work, but is not ``accepting`` new work.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import time
import uuid
from typing import Optional

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from common.protocol import (PROTOCOL_VERSION, Codec, Dead, Hello, Ping, ProtocolError,
                             version_mismatch)
from common.curve import CurveKey, client_security
from common.sockets import HANDSHAKE_FAILED, make_socket, waiting_messages

logger = logging.getLogger(__name__)

# Frames read in one turn of the event loop before it lets others run.
_BURST = 64
# While the service does not answer, the time between Hellos doubles from the
# heartbeat's up to this.
HELLO_INTERVAL_MAX_S = 30.0
# pyzmq's flags as plain ints: its enums cost a microsecond an operation.
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = (int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT),
                                        int(zmq.NOBLOCK))


class ServiceDeadError(RuntimeError):
    """The service is gone (or unreachable); the work did not complete."""


class ServiceRequestError(Exception):
    """The service refused or failed one piece of work (a RequestError or
    TokenizeError from the wire): ``kind`` says whose fault, ``param`` which field."""

    def __init__(self, error) -> None:
        super().__init__(error.message)
        self.message = error.message
        self.kind = error.kind
        self.param = getattr(error, "param", None)


class ServiceClient:
    #: Set by subclasses: what the service calls itself in messages and logs.
    service = "service"
    ready_type: type = msgspec.Struct
    pong_type: type = msgspec.Struct
    dead_error: type = ServiceDeadError

    def __init__(self, address: str, codec: Codec, *, client_id: Optional[str] = None,
                 heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 10.0,
                 stall_timeout_s: float = 300.0, process=None,
                 curve_key: Optional[CurveKey] = None) -> None:
        """``process``: the service's Popen/Process handle when this side started it;
        its exit is then noticed directly. ``curve_key``: the cluster's CURVE key, to
        present to the service (common/curve.py)."""
        self.address = address
        self.codec = codec
        self.client_id = client_id or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.process = process
        self.curve_key = curve_key
        self.ctx = zmq.Context()
        self.sock: Optional[zmq.Socket] = None
        self.ready = None
        self.dead_reason: Optional[str] = "not started"
        # Why the service refused this client (another protocol version), if it did.
        self.refusal: Optional[str] = None
        self.last_pong = None
        # The service said it is draining (finishing its work, taking none): it is
        # alive but takes nothing new. Cleared by a Ready from a new instance.
        self.draining = False
        self._last_pong_time = 0.0
        self._last_hello = -float("inf")
        self._hello_interval_s = heartbeat_interval_s
        self._ready_event = asyncio.Event()
        self._pings: dict[int, asyncio.Future] = {}
        self._nonces = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._monitor: Optional[zmq.Socket] = None
        # Frames a full send queue did not take yet, sent in order when it has room.
        self._backlog: collections.deque[list[bytes]] = collections.deque()
        self._pump_scheduled = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # -- lifecycle -------------------------------------------------------------

    async def connect(self) -> None:
        """Connect without waiting: the client is unavailable until the service's
        Ready arrives, whenever that is."""
        self.sock = make_socket(self.ctx, self.address, zmq.DEALER, bind=False,
                                identity=self.client_id.encode(),
                                secure=client_security(self.curve_key))
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.FD, self._pump)
        self._loop.add_reader(self._monitor.FD, self._read_monitor)
        self._loop.call_soon(self._read_monitor)  # it signals only once drained
        self._tasks = [asyncio.create_task(self._heartbeat_loop())]
        self._say_hello()

    async def start(self, timeout_s: float = 120.0):
        """Connect and wait for the service's Ready (it may still be loading). A service
        that refuses this client, at the CURVE handshake or for another protocol
        version, fails it at once."""
        await self.connect()
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            why = "" if self.dead_reason == "not started" else f" ({self.dead_reason})"
            raise self.dead_error(f"{self.service} at {self.address} did not answer within "
                                  f"{timeout_s:.0f} s{why}") from None
        if self.refusal is not None or self.ready is None:
            reason = self.refusal or self.dead_reason
            await self.close()
            raise self.dead_error(reason)
        return self.ready

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._fail(f"the {self.service} client closed")
        if self.sock is not None:
            assert self._loop is not None and self._monitor is not None
            self._loop.remove_reader(self.sock.FD)
            self._loop.remove_reader(self._monitor.FD)
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self.sock.close(linger=0)
            self.sock = None
            self._backlog.clear()
        self.ctx.term()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def accepting(self) -> bool:
        """Healthy and not draining: new work may go here."""
        return self.dead_reason is None and not self.draining

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise self.dead_error(self.dead_reason)

    async def ping(self, timeout_s: float = 5.0):
        """A round trip through the service's loop; raises the dead error on timeout."""
        self.check_alive()
        nonce = next(self._nonces)
        future = asyncio.get_running_loop().create_future()
        self._pings[nonce] = future
        try:
            self._send(Ping(nonce=nonce))
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise self.dead_error(f"no answer from the {self.service} within "
                                  f"{timeout_s:.1f} s") from None
        finally:
            self._pings.pop(nonce, None)

    # -- for subclasses --------------------------------------------------------

    def _dispatch(self, message: msgspec.Struct) -> None:
        """Handle a reply that is not Ready, Pong or Dead."""
        raise NotImplementedError

    def _fail_pending(self, error: Exception) -> None:
        """Fail every piece of work in flight with ``error``."""
        raise NotImplementedError

    def _instance_id(self, ready) -> str:
        """Identifies one run of the service (a restart gets a new one)."""
        raise NotImplementedError

    def _followed_ids(self) -> list[str]:
        """The work in flight that the service should keep (see Hello.request_ids)."""
        return []

    def _say_hello(self) -> None:
        self._send(Hello(client_id=self.client_id, request_ids=self._followed_ids(),
                         protocol_version=PROTOCOL_VERSION))
        self._last_hello = time.monotonic()

    # -- the socket -------------------------------------------------------------
    #
    # A plain ZeroMQ socket driven by the event loop, not zmq.asyncio: its file
    # descriptor says only "something changed" (edge-triggered), so on each signal
    # every waiting frame is read (up to _BURST per turn of the loop), and after
    # each send, which may take that signal, the socket is looked at again. No
    # future, task or reader registration per frame (zmq.asyncio's cost per frame
    # was a third of the frontend's Python time per streamed token).

    def _send(self, message: msgspec.Struct) -> None:
        """Send without waiting; frames leave in the order they are given (held
        here, in order, while the socket's queue to the service is full)."""
        if self.sock is None:
            return  # closed: nothing more goes out
        frames = self.codec.encode(message)
        if self._backlog or not self._try_send(frames):
            self._backlog.append(frames)
        self._schedule_pump()

    def _try_send(self, frames: list[bytes]) -> bool:
        assert self.sock is not None
        try:
            self.sock.send_multipart(frames, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and self._loop is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Send what the backlog holds while there is room; read and handle what
        has arrived."""
        self._pump_scheduled = False
        sock = self.sock
        for _ in range(_BURST):
            if sock is None or sock is not self.sock:
                return  # closed by a handler
            events = sock.getsockopt(_EVENTS)
            while self._backlog and events & _POLLOUT:
                if not self._try_send(self._backlog[0]):
                    break
                self._backlog.popleft()
                events = sock.getsockopt(_EVENTS)
            if not events & _POLLIN:
                return
            self._receive(sock.recv_multipart(_NOBLOCK))
        self._schedule_pump()  # more may be waiting: after others have had a turn

    def _receive(self, frames: list[bytes]) -> None:
        try:
            message = self.codec.decode(frames)
        except ProtocolError as e:
            logger.warning("dropped a frame from the %s: %s", self.service, e)
            return
        if isinstance(message, self.pong_type):
            self.last_pong = message
            self._last_pong_time = time.monotonic()
            if getattr(message, "draining", False) and not self.draining:
                logger.info("the %s at %s is draining", self.service, self.address)
                self.draining = True
            future = self._pings.get(message.nonce)
            if future is not None and not future.done():
                future.set_result(message)
            busy = getattr(message, "busy_s", 0.0)
            if busy > self.stall_timeout_s:
                self._mark_dead(f"the {self.service}'s loop has been stuck in one "
                                f"iteration for {busy:.0f} s")
        elif isinstance(message, self.ready_type):
            self._on_ready(message)
        elif isinstance(message, Dead) and self.ready is None:
            self._refuse(f"the {self.service} refused this client: {message.reason}")
        elif isinstance(message, Dead):
            self._mark_dead(f"{self.service} went down: {message.reason}")
        else:
            try:
                self._dispatch(message)
            except Exception:  # a bug in one handler must not stop the reading
                logger.exception("failed to handle a %s from the %s",
                                 type(message).__name__, self.service)

    def _refuse(self, reason: str) -> None:
        """The service will not serve this client (another protocol version): start()
        fails at once with the reason, and so does all work."""
        logger.error("%s", reason)
        self.refusal = self.dead_reason = reason
        self._fail(reason)
        self._ready_event.set()

    def _on_ready(self, ready) -> None:
        refusal = version_mismatch(self.service, ready.protocol_version)
        if refusal:
            self._refuse(refusal)
            return
        if self.ready is not None and self._instance_id(ready) != self._instance_id(self.ready):
            self._fail(f"the {self.service} restarted")
            self.draining = False
        self.ready = ready
        self.dead_reason = None
        self._hello_interval_s = self.heartbeat_interval_s
        self._last_pong_time = time.monotonic()
        self._ready_event.set()

    def _read_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        for frames in waiting_messages(monitor):
            self._on_connection_event(parse_monitor_message(frames)["event"])
            if monitor is not self._monitor:
                return  # closed by a handler

    def _on_connection_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            self._mark_dead(f"lost the connection to the {self.service} at "
                            f"{self.address}")
        elif event & HANDSHAKE_FAILED:
            reason = (f"the {self.service} at {self.address} refused the connection at "
                      f"the handshake: " + (
                          "it does not hold this client's CURVE key, or has none"
                          if self.curve_key else
                          "it requires a CURVE key (--curve-key-file)"))
            if self.ready is None and self.dead_reason != reason:
                logger.error("%s", reason)  # once, not at every reconnection
                self.dead_reason = reason  # what start() reports, at once
            self._mark_dead(reason)
            if self.ready is None:
                self._ready_event.set()   # start() fails; connect() alone keeps trying
        elif (event == zmq.EVENT_CONNECTED and self.ready is not None
              and time.monotonic() - self._last_hello >= self.heartbeat_interval_s):
            self._say_hello()   # reconnected (not every 100 ms to a service that refuses us)

    async def _heartbeat_loop(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.heartbeat_interval_s)
            if time.monotonic() - before > self.heartbeat_interval_s + 1.0:
                # Our own event loop was stalled: the service's pongs may be waiting
                # unread, so its silence is not evidence. Restart the clock.
                self._last_pong_time = time.monotonic()
            if self.process is not None and _exited(self.process):
                self._mark_dead(f"the {self.service} process exited")
            elif self.dead_reason is None:
                silent = time.monotonic() - self._last_pong_time
                if silent > self.heartbeat_timeout_s:
                    self._mark_dead(f"the {self.service} did not answer for {silent:.1f} s")
            if self.refusal is not None:
                continue  # asking again would be refused again
            if self.dead_reason is None:
                self._send(Ping(nonce=next(self._nonces)))
            elif time.monotonic() - self._last_hello >= self._hello_interval_s:
                # a service that comes back answers with Ready, which revives us
                self._say_hello()
                self._hello_interval_s = min(2 * self._hello_interval_s, HELLO_INTERVAL_MAX_S)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:  # the first cause is the one worth reporting
            logger.error("%s", reason)
            self.dead_reason = reason
        self._fail(self.dead_reason)

    def _fail(self, reason: str) -> None:
        error = self.dead_error(reason)
        self._fail_pending(error)
        for future in self._pings.values():
            if not future.done():
                future.set_exception(self.dead_error(reason))


def _exited(process) -> bool:
    poll = getattr(process, "poll", None)
    if poll is not None:  # subprocess.Popen
        return poll() is not None
    return not process.is_alive()  # multiprocessing.Process
