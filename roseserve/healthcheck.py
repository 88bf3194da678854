"""``python -m roseserve.healthcheck``: is a roseserve process alive? For container
health checks; exit status 0 when it is, 1 (with the reason) when not.

    python -m roseserve.healthcheck engine tcp://127.0.0.1:5557
    python -m roseserve.healthcheck tokenizer tcp://127.0.0.1:5558
    python -m roseserve.healthcheck kv-store tcp://127.0.0.1:5559
    python -m roseserve.healthcheck http http://127.0.0.1:8000/metrics

engine / tokenizer / kv-store: a Ping over the service's own socket and wire protocol, answered
within the timeout. An engine's pong (answered by its I/O thread) says how long its
loop has been in its current iteration (a step; about a second at most when idle):
longer than ``--stall`` (default 300 s, the frontend's own limit) is a hung loop and
fails the check: it sees through to the loop without waiting behind a step. With
``--ready`` (a readiness probe) a draining engine fails too: it is alive and
finishing its requests, but should be sent nothing new.

http: a GET answered with 2xx (the frontend's /metrics goes through its event loop
and depends on nothing else, so a frontend waiting for its engines is still healthy).
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.request
import uuid
from typing import Optional, Sequence

import zmq

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, POOL_REPLIES, POOL_REQUESTS,
                             STORE_REPLIES, STORE_REQUESTS, Codec, Ping, ProtocolError)
from common.curve import CurveKey, add_curve_args, client_security
from common.sockets import make_socket


def check_service(kind: str, address: str, timeout_s: float, stall_s: float,
                  ready: bool = False, curve_key: Optional[CurveKey] = None) -> Optional[str]:
    """None when healthy (and, with ``ready``, not draining), else why not.
    ``curve_key``: the cluster's, for a service that requires it."""
    codec = {"engine": Codec(CLIENT_MESSAGES, ENGINE_MESSAGES),
             "kv-store": Codec(STORE_REQUESTS, STORE_REPLIES)}.get(
        kind, Codec(POOL_REQUESTS, POOL_REPLIES))
    ctx = zmq.Context()
    sock = make_socket(ctx, address, zmq.DEALER, bind=False,
                       identity=f"healthcheck-{uuid.uuid4().hex[:8]}".encode(),
                       secure=client_security(curve_key))
    try:
        sock.send_multipart(codec.encode(Ping(nonce=1)))
        if not sock.poll(int(timeout_s * 1000)):
            return f"no answer from the {kind} at {address} within {timeout_s:g} s"
        try:
            pong = codec.decode(sock.recv_multipart())
        except ProtocolError as e:
            return f"the {kind} at {address} answered garbage: {e}"
        busy = getattr(pong, "busy_s", 0.0)
        if busy > stall_s:
            return f"the {kind}'s loop has been stuck in one iteration for {busy:.0f} s"
        if ready and getattr(pong, "draining", False):
            return f"the {kind} at {address} is draining (finishing its requests, taking none)"
        return None
    finally:
        sock.close(linger=0)
        ctx.term()


def open_local(url: str, timeout: float):
    """GET ``url`` of one of our own processes. Over HTTPS its certificate is not
    checked: the question is whether the process answers, not who it is (and a
    frontend's certificate names the host clients use, not the address probed)."""
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return urllib.request.urlopen(url, timeout=timeout, context=context)


def check_http(url: str, timeout_s: float) -> Optional[str]:
    try:
        with open_local(url, timeout_s) as response:
            return None if 200 <= response.status < 300 else f"{url}: {response.status}"
    except OSError as e:
        return f"{url}: {e}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m roseserve.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["engine", "tokenizer", "kv-store", "http"])
    parser.add_argument("address", help="the service's socket address, or a URL for http")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--stall", type=float, default=300.0)
    parser.add_argument("--ready", action="store_true",
                        help="also fail while the engine drains: a readiness check (it "
                             "is alive, but should be sent nothing new)")
    add_curve_args(parser, binds=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kind == "http":
        problem = check_http(args.address, args.timeout)
    else:
        try:
            key = CurveKey.from_option(args.curve_key_file)
        except ValueError as e:
            parser.error(str(e))
        problem = check_service(args.kind, args.address, args.timeout, args.stall, args.ready,
                                key)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
