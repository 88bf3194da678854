"""The frontend's listening socket as it stops: new handshakes dropped, those the kernel
had begun completed and queued (frontend/http_server.py). The whole stop under load is
tests/e2e/test_reliability.py's."""

from __future__ import annotations

import ctypes
import errno
import socket
import struct
import sys
import time

import pytest

from frontend.http_server import accept_queue_length, stop_handshakes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="socket filters are Linux's")

_DROP_ALL = struct.pack("@HBBI", 0x06, 0, 0, 0)  # BPF_RET | BPF_K, k = 0
_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
_SO_DETACH_FILTER = getattr(socket, "SO_DETACH_FILTER", 27)


def _deaf(sock: socket.socket) -> ctypes.Array:
    """Make ``sock`` drop every packet it receives (returns the program, to keep it
    alive while attached)."""
    program = ctypes.create_string_buffer(_DROP_ALL, len(_DROP_ALL))
    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                    struct.pack("@HP", 1, ctypes.addressof(program)))
    return program


def _queued_within(listener: socket.socket, count: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if accept_queue_length(listener) >= count:
            return True
        time.sleep(0.01)
    return False


def test_a_handshake_half_done_when_handshakes_stop_completes_and_is_queued():
    """A client whose SYN the listener answered before it stopped, and whose ACK comes
    after: its connect() succeeds, so the listener must take the connection (dropping
    the ACK left it half-open, and closing the listener then reset a client that had
    sent its request). The client's own filter holds back the server's SYN-ACK until
    the listener has stopped; the server sends it again a second later."""
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.socket() as late, socket.socket() as new:
        program = _deaf(late)
        late.setblocking(False)
        assert late.connect_ex(listener.getsockname()) == errno.EINPROGRESS
        time.sleep(0.2)  # the server's SYN-ACK went out, and was dropped
        assert accept_queue_length(listener) == 0
        assert stop_handshakes(listener)
        late.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        del program
        assert _queued_within(listener, 1, 4.0), "the half-done handshake was dropped"
        conn, _ = listener.accept()
        with conn:
            late.setblocking(True)
            late.sendall(b"ping")
            assert conn.recv(4) == b"ping"
        # A handshake begun after the stop gets no answer (its client retries, and is
        # refused once the listener closes).
        new.settimeout(0.5)
        with pytest.raises(socket.timeout):
            new.connect(listener.getsockname())
        assert accept_queue_length(listener) == 0


def test_connections_queued_before_handshakes_stop_stay_queued():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
        try:
            assert _queued_within(listener, 3, 2.0)
            assert stop_handshakes(listener)
            assert accept_queue_length(listener) == 3
            for client in clients:
                client.sendall(b"x")
            for _ in clients:
                conn, _ = listener.accept()
                with conn:
                    assert conn.recv(1) == b"x"
            assert accept_queue_length(listener) == 0
        finally:
            for client in clients:
                client.close()
