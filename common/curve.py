"""CURVE authentication of the internal ZeroMQ sockets (libzmq's CurveZMQ through pyzmq:
its handshake, encryption and ZAP authenticator, rather than anything of our own).

Model: one cluster key, a ZeroMQ secret certificate file (``python -m roseserve keygen
FILE``) that every process of a cluster reads: a Docker or Kubernetes secret, named by
``--curve-key-file`` or ``ROSESERVE_CURVE_KEY_FILE``.

  * A service (engine, tokenizer pool) that has the key binds its socket as a CURVE
    server, and its ZAP handler (pyzmq's ThreadAuthenticator) admits only clients
    whose public key is the cluster's, that is, clients that hold the cluster's
    secret key. Any other peer fails the handshake before a frame of it is read: it
    can neither submit nor read, and the failure is counted.
  * A client (frontend, health check) that has the key connects every socket as a
    CURVE client presenting it.
  * Without a key the sockets are plain, as over loopback (``roseserve serve``). A
    service refuses to bind beyond loopback without one unless told
    ``--insecure-no-curve`` (``check_bind``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from common.config import env_default
from common.sockets import is_loopback


@dataclass(frozen=True)
class CurveKey:
    public: bytes  # Z85, 40 characters
    secret: bytes
    path: str

    @classmethod
    def load(cls, path: str) -> "CurveKey":
        """The key pair in a ZeroMQ secret certificate; ValueError saying what is wrong."""
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the CURVE key file {path}: {e}") from None
        if not secret:
            raise ValueError(f"{path} holds no secret key: it is a public certificate; "
                             f"give the secret one (python -m roseserve keygen FILE)")
        return cls(public=public, secret=secret, path=path)

    @classmethod
    def from_option(cls, path: Optional[str]) -> Optional["CurveKey"]:
        return None if not path else cls.load(path)


def create_key_file(path: str) -> CurveKey:
    """Write a new cluster key (a secret certificate, readable by its owner only)."""
    with tempfile.TemporaryDirectory() as tmp:
        _, secret_file = zmq.auth.create_certificates(tmp, "roseserve")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        shutil.copyfile(secret_file, path)
    os.chmod(path, 0o600)
    return CurveKey.load(path)


def add_curve_args(parser: argparse.ArgumentParser, binds: bool) -> None:
    """--curve-key-file, and for a process that binds, --insecure-no-curve."""
    parser.add_argument("--curve-key-file", default=env_default("CURVE_KEY_FILE"),
                        help="the cluster's CURVE key (a ZeroMQ secret certificate: "
                             "python -m roseserve keygen FILE), for the internal sockets")
    if binds:
        parser.add_argument("--insecure-no-curve", action="store_true",
                            default=env_default("INSECURE_NO_CURVE") == "1",
                            help="bind beyond loopback without a CURVE key: any peer that "
                                 "reaches the socket is served")


def key_for_bind(address: str, path: Optional[str], insecure: bool) -> Optional[CurveKey]:
    """The key a service binding ``address`` uses (ValueError: unreadable, or none
    beyond loopback without ``insecure``)."""
    key = CurveKey.from_option(path)
    check_bind(address, key, insecure)
    return key


def check_bind(address: str, key: Optional[CurveKey], insecure: bool) -> None:
    """Refuse (ValueError) to bind beyond loopback with no key, unless told to."""
    if key is None and not insecure and not is_loopback(address):
        raise ValueError(
            f"binding {address} reaches beyond this host, so peers must authenticate: give "
            f"a cluster key with --curve-key-file (or ROSESERVE_CURVE_KEY_FILE; create one "
            f"with `python -m roseserve keygen FILE`), or pass --insecure-no-curve to "
            f"accept any peer that can reach the socket")


class _ClusterKeys:
    """The ZAP decision: a client is admitted when it presents the cluster's key."""

    def __init__(self, public: bytes) -> None:
        self.public = public
        self.num_denied = 0

    def callback(self, domain: str, client_public_z85: bytes) -> bool:
        if client_public_z85 == self.public:
            return True
        self.num_denied += 1
        return False


class CurveServer:
    """CURVE for a service's sockets in one context: the ZAP handler that checks every
    handshake, and the options that make a socket a CURVE server. Stop it before the
    context is terminated."""

    def __init__(self, ctx: zmq.Context, key: CurveKey) -> None:
        self.key = key
        self.keys = _ClusterKeys(key.public)
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback("*", self.keys)

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server."""
        sock.curve_secretkey = self.key.secret
        sock.curve_publickey = self.key.public
        sock.curve_server = True

    @property
    def num_denied(self) -> int:
        """Handshakes refused for a key other than the cluster's."""
        return self.keys.num_denied

    def stop(self) -> None:
        self.auth.stop()


def client_security(key: Optional[CurveKey]) -> Optional[Callable[[zmq.Socket], None]]:
    """For make_socket's ``secure``: what makes a socket (not yet connected) a CURVE
    client presenting the cluster key; None without a key."""
    if key is None:
        return None

    def secure(sock: zmq.Socket) -> None:
        sock.curve_serverkey = key.public
        sock.curve_publickey = key.public
        sock.curve_secretkey = key.secret

    return secure
