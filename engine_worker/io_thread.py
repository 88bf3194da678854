"""The engine worker's I/O thread: it owns the ROUTER socket the clients talk to.

It decodes client frames (a malformed, truncated or unknown frame is counted and
dropped; a frame over the size limit costs its sender the connection), answers pings
itself with the stats the engine loop last published, so that liveness never depends
on how long a step takes, and passes everything else to the loop's inbox. It also
carries the loop's KV pulls to other engines (PEER_OUTBOX_ADDRESS) and their answers
back, and wakes the loop when a signal arrives (Python's wakeup fd). With the
cluster's CURVE key (common/curve.py) the socket serves only clients presenting it;
other peers fail the handshake and are counted. engine_worker/server.py is the loop.

The loop sends its replies on the ROUTER itself (``send``), without waiting: a step's
outputs leave from the thread that made them. A hop through this thread woke it once
per step, 0.08-0.2 ms of CPU a step at one stream (2-core AMD EPYC), taken from the
model's threads. A ZeroMQ socket may be used from several threads one
at a time (a lock: a full memory barrier between uses), so every use of the ROUTER
holds ``lock``, and this thread waits on the socket's file descriptor, not on the
socket. That descriptor only says that the socket has work since it was last used:
a send in the loop may take the news of an arriving frame, so a send that leaves
frames waiting says so through a pipe this thread also watches.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

import msgspec
import zmq

from common.config import EngineServerConfig
from common.curve import CurveServer, client_security
from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, STORE_REPLIES, Codec, Dead,
                             EngineStats, KvBlocks, Ping, Pong, ProtocolError, RequestError,
                             StorePong)
from common.sockets import (DEFAULT_HWM, HANDSHAKE_FAILED, make_socket, read_refusal,
                            waiting_messages)

logger = logging.getLogger(__name__)

# The loop's frames to other engines (KV pulls) and the KV store: [address, type, payload].
PEER_OUTBOX_ADDRESS = "inproc://engine-peer-outbox"
# The KV store's puts go to PUT_CHANNEL + its address (_peer); at most STORE_PUT_HWM
# of them (each of at most kv_store_link.PUT_FRAME_BYTES) wait there before more are
# dropped.
PUT_CHANNEL = "put+"
STORE_PUT_HWM = 32


class Wake:
    """Put in the inbox by the I/O thread to wake the loop (a signal, a failure)."""


@dataclass(frozen=True)
class Peer:
    """The sender of a message from another engine (a prefill engine's KvBlocks)."""

    address: str


class PeerLost:
    """Put in the inbox when the connection to a peer engine drops."""


class IOThread(threading.Thread):
    """Owns the ROUTER socket: client frames in (decoded), pings answered; the loop's
    replies go out through ``send``."""

    def __init__(self, ctx: zmq.Context, config: EngineServerConfig, inbox: "queue.Queue",
                 stats: EngineStats, curve: Optional[CurveServer]) -> None:
        super().__init__(name="engine-io", daemon=True)
        self.ctx = ctx
        self.inbox = inbox
        self.codec = Codec(ENGINE_MESSAGES, CLIENT_MESSAGES)
        # Created here so that bind errors surface in the constructor's caller.
        self.router = make_socket(ctx, config.bind, zmq.ROUTER, bind=True, linger_ms=1000,
                                  max_message_bytes=config.max_frame_bytes,
                                  secure=curve.secure if curve else None)
        # Sending to a client that is gone raises instead of silently dropping.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.lock = threading.Lock()  # held for every use of the ROUTER
        self.router_fd = self.router.getsockopt(zmq.FD)
        # Written by a sender that left frames waiting (or by close()): wakes this thread.
        self.nudge_read, self.nudge_write = os.pipe()
        os.set_blocking(self.nudge_read, False)
        os.set_blocking(self.nudge_write, False)
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        # Other engines this one pulls KV from: a DEALER each, made on first use.
        self.peer_outbox = make_socket(ctx, PEER_OUTBOX_ADDRESS, zmq.PULL, bind=True)
        self.peer_codec = Codec(CLIENT_MESSAGES, {**ENGINE_MESSAGES, **STORE_REPLIES})
        self.peers: dict[str, zmq.Socket] = {}
        # Frames to other engines or the store dropped: the peer is not reading (the
        # transfer's deadline, or the store link's backoff, takes it from there).
        self.num_peer_frames_dropped = 0
        self.peer_monitors: dict[zmq.Socket, str] = {}
        self.curve_key = config.curve_key
        self.max_frame_bytes = config.max_frame_bytes
        self.unreachable: "queue.Queue[bytes]" = queue.Queue()
        # Read end of the signal wakeup pipe (EngineServer sets it).
        self.wakeup_fd: Optional[int] = None
        # Published by the engine loop: its latest stats. Plain attribute writes:
        # atomic under the GIL.
        self.stats = stats
        # Set by the loop when a drain starts; every later pong says so.
        self.draining = False
        # When the engine loop began its current iteration (set by the loop): a pong
        # reports how long ago, so a loop stuck anywhere (a step, a lock) shows.
        self.loop_at = time.monotonic()
        # Monotonic time of each client's last frame, read by the loop to expire
        # silent clients (a ping counts: it is answered here, never seen there).
        self.last_seen: dict[bytes, float] = {}
        self.num_frames_dropped = 0
        self.num_disconnects = 0
        self.num_handshakes_failed = 0
        self.stopping = False
        self.failed = False

    def run(self) -> None:
        self.poller = poller = zmq.Poller()
        poller.register(self.router_fd, zmq.POLLIN)
        poller.register(self.nudge_read, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.peer_outbox, zmq.POLLIN)
        if self.wakeup_fd is not None:
            poller.register(self.wakeup_fd, zmq.POLLIN)
        try:
            self._receive()  # what arrived before the descriptor was watched
            while not self.stopping:
                for sock, _ in poller.poll():
                    if sock == self.router_fd:
                        self._receive()
                    elif sock == self.nudge_read:
                        os.read(self.nudge_read, 512)
                        self._receive()
                    elif sock is self.monitor:
                        if read_refusal(self.monitor):
                            self.num_handshakes_failed += 1
                        else:
                            self.num_disconnects += 1
                    elif sock is self.peer_outbox:
                        self._to_peers()
                    elif sock in self.peer_monitors:
                        sock.recv_multipart()
                        self.inbox.put((Peer(self.peer_monitors[sock]), PeerLost()))
                    elif isinstance(sock, zmq.Socket):
                        self._from_peer(sock)
                    else:  # a signal arrived: the loop looks at its counter
                        os.read(self.wakeup_fd, 512)
                        self.inbox.put(Wake())
        except Exception:  # the loop learns of it through a Wake and exits nonzero
            logger.exception("engine I/O thread failed")
            self.failed = True
            self.inbox.put(Wake())

    def _receive(self) -> None:
        with self.lock:
            received = list(waiting_messages(self.router))
        for frames in received:
            identity, body = frames[0], frames[1:]
            self.last_seen[identity] = time.monotonic()
            try:
                message = self.codec.decode(body)
            except ProtocolError as e:
                self.num_frames_dropped += 1
                logger.warning("dropped a frame from client %r: %s", identity, e)
                if e.request_id is not None:  # the request it was for fails, not hangs
                    self.send([identity, *self.codec.encode(RequestError(
                        request_id=e.request_id, message=f"undecodable request: {e}"))])
                continue
            if isinstance(message, Ping):
                self._pong(identity, message)
            else:
                self.inbox.put((identity, message))

    def _to_peers(self) -> None:
        for address, *frames in waiting_messages(self.peer_outbox):
            try:
                self._peer(address.decode()).send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: the peer is not reading
                self.num_peer_frames_dropped += 1

    def _peer(self, address: str) -> zmq.Socket:
        """The DEALER to a peer (made on first use). ``PUT_CHANNEL + address``: a second
        one to the KV store for puts, which queues few frames (of many blocks each)
        before it drops them, so that puts never crowd out pulls; it is answered
        nothing, and a dropped connection is the pulls' socket's to report."""
        sock = self.peers.get(address)
        if sock is None:
            puts = address.startswith(PUT_CHANNEL)
            sock = make_socket(self.ctx, address.removeprefix(PUT_CHANNEL), zmq.DEALER,
                               bind=False, max_message_bytes=self.max_frame_bytes,
                               hwm=STORE_PUT_HWM if puts else DEFAULT_HWM,
                               secure=client_security(self.curve_key))
            self.peers[address] = sock
            if not puts:
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
                self.peer_monitors[monitor] = address
                self.poller.register(sock, zmq.POLLIN)
                self.poller.register(monitor, zmq.POLLIN)
        return sock

    def _from_peer(self, sock: zmq.Socket) -> None:
        address = next(a for a, s in self.peers.items() if s is sock)
        for frames in waiting_messages(sock):
            try:
                message = self.peer_codec.decode(frames)
            except ProtocolError as e:
                self.num_frames_dropped += 1
                logger.warning("dropped a frame from engine %s: %s", address, e)
                continue
            if isinstance(message, (KvBlocks, Dead, StorePong)):
                self.inbox.put((Peer(address), message))

    def _pong(self, identity: bytes, ping: Ping) -> None:
        stats = msgspec.structs.replace(self.stats, num_frames_dropped=self.num_frames_dropped,
                                        num_disconnects=self.num_disconnects,
                                        num_handshakes_failed=self.num_handshakes_failed)
        pong = Pong(nonce=ping.nonce, stats=stats,
                    busy_s=time.monotonic() - self.loop_at, draining=self.draining)
        self.send([identity, *self.codec.encode(pong)])

    def send(self, frames: list[bytes]) -> None:
        """Send [identity, *frames] to a client, from any thread, without waiting; a
        client that is gone, or that has stopped reading, is reported to the loop."""
        with self.lock:
            try:
                self.router.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
                logger.info("client %r unreachable (%s)", frames[0], e)
                self.unreachable.put(frames[0])
            waiting = self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN
        if waiting:  # this send took the news of them from the descriptor
            self._nudge()

    def _nudge(self) -> None:
        try:
            os.write(self.nudge_write, b"\0")
        except BlockingIOError:  # the pipe is full: this thread has been woken already
            pass

    def close(self) -> None:
        """Stop and close, lingering so that the last frames (DEAD among them) reach
        the clients. Called by the loop after its last send."""
        self.stopping = True
        self._nudge()
        self.join(timeout=5)
        self.router.disable_monitor()
        self.monitor.close(linger=0)
        self.router.close()
        self.peer_outbox.close()
        os.close(self.nudge_read)
        os.close(self.nudge_write)
        for sock in self.peers.values():
            sock.disable_monitor()
            sock.close(linger=0)
        for monitor in self.peer_monitors:
            monitor.close(linger=0)
