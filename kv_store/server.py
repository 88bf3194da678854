"""The KV store process: a ROUTER socket, one thread, the blocks (kv_store/store.py).

Engines put blocks (KvPut: no answer) and pull them (KvPull: a KvBlocks answer, the
leading blocks held in the order asked, ``error`` set where it stopped short because
the next one is not held); health checks ping (StorePong, with StoreStats). A frame
that does not decode is counted and dropped; one over the size limit costs its sender
the connection. Nothing here can make an engine compute a wrong token: an engine
checks every block it pulls (kv_transfer.py: order, chained hash, size, CRC-32) and
computes what does not arrive. SIGTERM or SIGINT: the blocks in memory are written to
the disk tier, if there is one, and the process exits 0.
"""

from __future__ import annotations

import logging
import signal

import zmq

from common.config import KvStoreConfig
from common.curve import CurveServer
from common.protocol import (STORE_REPLIES, STORE_REQUESTS, Codec, KvBlocks, KvPull, KvPut,
                             Ping, ProtocolError, StorePong)
from common.sockets import make_socket, waiting_messages
from kv_store.store import BlockStore

logger = logging.getLogger("kv_store")

NOT_HELD = "the KV store does not hold the block"


class KvStoreServer:
    def __init__(self, config: KvStoreConfig) -> None:
        self.config = config
        self.store = BlockStore(config.memory_bytes, config.disk_dir, config.disk_bytes)
        self.ctx = zmq.Context()
        self.curve = CurveServer(self.ctx, config.curve_key) if config.curve_key else None
        try:
            self.router = make_socket(self.ctx, config.bind, zmq.ROUTER, bind=True,
                                      max_message_bytes=config.max_frame_bytes,
                                      secure=self.curve.secure if self.curve else None)
        except Exception:
            self._stop_curve()
            raise
        self.codec = Codec(STORE_REPLIES, STORE_REQUESTS)
        self.num_frames_dropped = 0
        self.num_signals = 0

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        logger.info("KV store serving on %s: %.1f GiB in memory%s", self.config.bind,
                    self.config.memory_bytes / 2**30,
                    f", spilling to {self.config.disk_dir}" if self.config.disk_dir else "")
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self.num_signals:
            if poller.poll(500):
                for frames in waiting_messages(self.router):
                    self.handle(frames)
        logger.info("signal: stopping")
        self.store.flush()
        self.router.close(linger=0)
        self._stop_curve()
        self.ctx.term()
        return 0

    def _on_signal(self, _signum, _frame) -> None:
        self.num_signals += 1

    def handle(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        try:
            message = self.codec.decode(body)
        except ProtocolError as e:
            self.num_frames_dropped += 1
            logger.warning("dropped a frame from %r: %s", identity, e)
            return
        try:
            if isinstance(message, KvPut):
                for block in message.blocks:
                    self.store.put(message.layout, block)
            elif isinstance(message, KvPull):
                self._send(identity, self.answer(message))
            elif isinstance(message, Ping):
                self._send(identity, StorePong(nonce=message.nonce, stats=self.store.stats()))
        except Exception:  # (a disk that failed): this message's loss, not the store's
            logger.exception("handling a %s from %r failed", type(message).__name__, identity)
            self.num_frames_dropped += 1

    def answer(self, pull: KvPull) -> KvBlocks:
        """The leading blocks of those asked for that the store holds, at most a
        window's bytes of them."""
        blocks, size, error = [], 0, None
        for block_hash in pull.hashes:
            block = self.store.get(pull.layout, block_hash)
            if block is None:
                error = NOT_HELD
                break
            if blocks and size + len(block.data) > self.config.window_bytes:
                break   # the engine asks again for the rest
            blocks.append(block)
            size += len(block.data)
        return KvBlocks(request_id=pull.request_id, blocks=blocks, error=error)

    def _send(self, identity: bytes, message) -> None:
        try:
            self.router.send_multipart([identity, *self.codec.encode(message)], zmq.NOBLOCK)
        except zmq.Again:  # the peer stopped reading: it asks again or computes
            self.num_frames_dropped += 1

    def _stop_curve(self) -> None:
        if self.curve is not None:
            self.curve.stop()
