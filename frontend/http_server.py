"""The HTTP server: uvicorn's, stopping without resetting a connection it took."""

from __future__ import annotations

import asyncio
import ctypes
import socket
import struct
import sys
import time

import uvicorn

# A classic BPF program dropping a connection's first packet, a SYN without ACK (a
# listening socket's filter sees each TCP segment from its header on; byte 13 holds the
# flags). The ACK ending a handshake the listener had answered goes through: dropping
# it too would leave a client whose connect() succeeded half-open, and then reset.
_SYN, _ACK = 0x02, 0x10
_DROP_NEW_HANDSHAKES = b"".join(struct.pack("@HBBI", *op) for op in (
    (0x30, 0, 0, 13),           # ldb [13]: the TCP flags
    (0x45, 1, 0, _ACK),         # jset ACK: keep
    (0x45, 1, 0, _SYN),         # jset SYN: drop
    (0x06, 0, 0, 0xFFFFFFFF),   # ret all: keep
    (0x06, 0, 0, 0),            # ret 0: drop
))
_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
# struct tcp_info (its first 104 bytes, Linux's since 2.6): on a listening socket,
# tcpi_unacked is its accept queue's length.
_TCP_INFO_BYTES, _TCPI_UNACKED_OFFSET = 104, 24


def stop_handshakes(sock) -> bool:
    """Make a listening socket drop the handshakes of new connections (their clients
    retry the SYN, and are refused once the socket is closed), completing those it had
    answered and keeping what its accept queue holds. False where it cannot (not
    Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    program = ctypes.create_string_buffer(_DROP_NEW_HANDSHAKES, len(_DROP_NEW_HANDSHAKES))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                        struct.pack("@HP", len(_DROP_NEW_HANDSHAKES) // 8,
                                    ctypes.addressof(program)))
    except OSError:
        return False
    return True


def accept_queue_length(sock) -> int:
    """Connections a listening socket's kernel queue holds, not yet accepted (0 where
    it cannot be read)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError):
        return 0
    return struct.unpack_from("I", info, _TCPI_UNACKED_OFFSET)[0]


class Server(uvicorn.Server):
    """uvicorn's server, stopping without resetting a connection: closing a listening
    socket resets every connection still in its accept queue, though each of their
    clients saw its connect() succeed and sent its request. So on SIGTERM new
    handshakes stop first, the queued connections are accepted and their requests
    read (up to a second), and then uvicorn's graceful shutdown closes the listeners
    and lets what it took finish."""

    async def shutdown(self, sockets=None) -> None:
        listeners = [s for server in self.servers for s in server.sockets]
        if any([stop_handshakes(s) for s in listeners]):
            deadline = time.monotonic() + 1.0
            while (time.monotonic() < deadline
                   and any(accept_queue_length(s) for s in listeners)):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the requests of the connections just accepted
        await super().shutdown(sockets)
