"""ZeroMQ socket creation: the one place that decides bind or connect, high-water
marks and linger, so every process configures its sockets the same way."""

from __future__ import annotations

import ipaddress
import os
from typing import Optional, Union
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

AnyContext = Union[zmq.Context, zmq.asyncio.Context]

# Messages queued per peer before a send would block. Output frames are small (one
# per step), so this is hours of backlog, not a memory risk.
DEFAULT_HWM = 100_000


def make_socket(ctx: AnyContext, address: str, socket_type: int, *, bind: bool,
                identity: Optional[bytes] = None, hwm: int = DEFAULT_HWM,
                linger_ms: int = 0, max_message_bytes: Optional[int] = None) -> zmq.Socket:
    """A socket bound or connected to ``address`` (tcp://host:port or ipc://path).

    ``linger_ms`` is how long close() may wait to flush unsent messages; 0 drops them
    (a process that is exiting anyway), more for last words such as a DEAD frame.
    ``max_message_bytes``: a peer that sends a larger frame is disconnected before
    the frame is buffered (ZeroMQ's MAXMSGSIZE); services facing clients set it.
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
