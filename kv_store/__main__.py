"""python -m kv_store: the shared KV store engines keep prefix blocks in.

    python -m kv_store --memory 64 --disk-dir /var/cache/roseserve-kv \
        --bind tcp://0.0.0.0:5559 --curve-key-file cluster.key   # beyond loopback: only
                                                                  # holders of the key
Engines use it with ``--kv-store-address tcp://HOST:5559``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from common.config import DEFAULT_KV_STORE_ADDRESS, KvStoreConfig, env_default
from common.curve import add_curve_args, key_for_bind
from common.logging_setup import setup_logging
from common.sockets import is_loopback

logger = logging.getLogger("kv_store")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kv_store", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bind", default=env_default("KV_STORE_ADDRESS", DEFAULT_KV_STORE_ADDRESS),
                   help="address of the store's socket (tcp://host:port or ipc://path)")
    p.add_argument("--memory", type=float, default=4.0, metavar="GIB",
                   help="blocks kept in memory, least recently used first out (default 4)")
    p.add_argument("--disk-dir", default=env_default("KV_STORE_DIR"), metavar="DIR",
                   help="blocks pushed out of memory kept in files under DIR (and found "
                        "again after a restart)")
    p.add_argument("--disk", type=float, default=32.0, metavar="GIB",
                   help="the most each layout's blocks take under --disk-dir (default 32)")
    p.add_argument("--window-bytes", type=int, default=8 << 20,
                   help="the most block bytes one answer holds")
    add_curve_args(p, binds=True)
    p.add_argument("--log-level", default=None)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("kv_store", args.log_level)
    try:
        if not args.memory * 2**30 >= 1 or not args.disk * 2**30 >= 1:
            raise ValueError("--memory and --disk must be positive")
        config = KvStoreConfig(bind=args.bind, memory_bytes=int(args.memory * 2**30),
                               disk_dir=args.disk_dir, disk_bytes=int(args.disk * 2**30),
                               window_bytes=args.window_bytes,
                               curve_key=key_for_bind(args.bind, args.curve_key_file,
                                                      args.insecure_no_curve))
    except ValueError as e:
        parser.error(str(e))
    if not is_loopback(config.bind):
        logger.warning("binding %s: reachable beyond this host, as asked (%s)", config.bind,
                       "peers must hold the cluster's CURVE key" if config.curve_key
                       else "WITHOUT authentication")
    from kv_store.server import KvStoreServer

    try:
        server = KvStoreServer(config)
    except Exception as e:  # zmq.ZMQError: address in use, bad address
        logger.error("cannot bind %s: %s", config.bind, e)
        return 2
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
