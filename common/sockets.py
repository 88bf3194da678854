"""ZeroMQ socket creation: the one place that decides bind or connect, high-water
marks and linger, so every process configures its sockets the same way."""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from typing import Callable, Iterator, Optional
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)


# Messages queued per peer before a send would block. Output frames are small (one
# per step), so this is hours of backlog, not a memory risk.
DEFAULT_HWM = 100_000


def waiting_messages(sock: zmq.Socket) -> Iterator[list[bytes]]:
    """Every message the socket holds now, read without waiting."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


def make_socket(ctx: zmq.Context, address: str, socket_type: int, *, bind: bool,
                identity: Optional[bytes] = None, hwm: int = DEFAULT_HWM,
                linger_ms: int = 0, max_message_bytes: Optional[int] = None,
                secure: Optional[Callable[[zmq.Socket], None]] = None) -> zmq.Socket:
    """A socket bound or connected to ``address`` (tcp://host:port or ipc://path).

    ``linger_ms`` is how long close() may wait to flush unsent messages; 0 drops them
    (a process that is exiting anyway), more for last words such as a DEAD frame.
    ``max_message_bytes``: a peer that sends a larger frame is disconnected before
    the frame is buffered (ZeroMQ's MAXMSGSIZE); services facing clients set it.
    ``secure``: sets the socket's CURVE options before it binds or connects
    (common/curve.py).
    """
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if address.startswith("tcp://["):  # an IPv6 literal (a DNS answer, say)
        sock.setsockopt(zmq.IPV6, 1)
    if secure is not None:
        secure(sock)
    if bind:
        if address.startswith("ipc://"):
            os.makedirs(os.path.dirname(address[len("ipc://"):]) or ".", exist_ok=True)
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def is_loopback(address: str) -> bool:
    """Whether binding ``address`` exposes nothing beyond this host."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Socket-monitor events of a connection refused at the handshake (CURVE).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


# A refused peer reconnects every 100 ms: its refusals are logged this often at most.
REFUSAL_LOG_INTERVAL_S = 10.0
_last_refusal_log = [-REFUSAL_LOG_INTERVAL_S]


def read_refusal(monitor: zmq.Socket) -> bool:
    """Read one event from a service socket's monitor (watching EVENT_DISCONNECTED and
    HANDSHAKE_FAILED): True for a connection refused at the handshake (logged), False
    for a disconnection."""
    event = parse_monitor_message(monitor.recv_multipart())
    if not event["event"] & HANDSHAKE_FAILED:
        return False
    now = time.monotonic()
    if now - _last_refusal_log[0] >= REFUSAL_LOG_INTERVAL_S:
        _last_refusal_log[0] = now
        logger.warning("refused a connection at the handshake on %s: a peer without the "
                       "cluster's CURVE key, or without CURVE (logged every %.0f s at "
                       "most; the service's pong counts them)",
                       event["endpoint"].decode(errors="replace"), REFUSAL_LOG_INTERVAL_S)
    return True
