"""KV blocks in files: a file a block under a directory of the KV layout's, least
recently used first out past a byte budget, written by a thread of its own and checked
when read (the layout's directory, the block's hash and token ids, its size, CRC-32).
The disk tier below an engine's pool (engine_worker/kv_offload.py) and the shared KV
store's spill (kv_store/) are one of these each."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import uuid
import zlib
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]

def layout_dir(root: str, layout: str) -> Path:
    """Where a layout's blocks lie under ``root``."""
    return Path(root) / hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()


_MAGIC = b"RSKV1\0"
_HEADER = struct.Struct("<6s16sIQI")  # magic, hash, CRC-32, data bytes, token count


class DiskTier:
    """Evicted blocks in files, one a block, under a directory of the KV layout's;
    least recently used first out past a byte budget. Written by a thread of its own;
    read, and checked, by the caller."""

    # Blocks waiting for the writer: beyond these, a block is dropped.
    QUEUE_BLOCKS = 256

    def __init__(self, root: str, layout: str, budget_bytes: int,
                 block_bytes: Optional[int]) -> None:
        """block_bytes: every block's size (None: any, as its file says)."""
        self.block_bytes = block_bytes
        self.budget_bytes = budget_bytes
        self.dir = layout_dir(root, layout)
        self.dir.mkdir(parents=True, exist_ok=True)
        marker = self.dir / "LAYOUT"
        if marker.exists() and marker.read_text() != layout:
            raise ValueError(f"{self.dir} holds KV blocks of another layout")
        marker.write_text(layout)
        self.lock = threading.Lock()
        # hash -> file size, least recently used first (the files' times at start)
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.nbytes = 0
        found = []
        for path in self.dir.glob("*.kv"):
            try:
                found.append((path.stat().st_mtime, bytes.fromhex(path.stem), path.stat().st_size))
            except (OSError, ValueError):
                continue
        for _, block_hash, size in sorted(found):
            self.entries[block_hash] = size
            self.nbytes += size
        self.errors: Counter = Counter()
        # blocks to write, and events to set once those before them are written
        self._queue: queue.Queue = queue.Queue(self.QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
        self._writer.start()
        self._trim()
        if self.entries:
            logger.info("KV disk tier %s: %d block(s) found", self.dir, len(self.entries))

    def __len__(self) -> int:
        return len(self.entries)

    def path(self, block_hash: bytes) -> Path:
        return self.dir / f"{block_hash.hex()}.kv"

    def holds(self, block_hash: bytes) -> bool:
        with self.lock:
            return block_hash in self.entries

    def put(self, block_hash: bytes, token_ids: Tokens, data: bytes, wait_s: float = 0.0
            ) -> bool:
        """Queue a block for writing, waiting up to ``wait_s`` for room; whether it was
        queued (or is on disk already). A block the writer has no room for is dropped
        and counted."""
        with self.lock:
            if block_hash in self.entries:
                self.entries.move_to_end(block_hash)
                return True
        try:
            self._queue.put((block_hash, token_ids, data), timeout=wait_s) if wait_s > 0 \
                else self._queue.put_nowait((block_hash, token_ids, data))
        except queue.Full:
            self.errors["disk_queue_full"] += 1
            return False
        return True

    def get(self, block_hash: bytes, token_ids: Tokens) -> Optional[bytes]:
        """The block's bytes, if its file is there and passes every check; a file that
        fails one is deleted."""
        path = self.path(block_hash)
        try:
            raw = path.read_bytes()
        except OSError:
            self._forget(block_hash, None)
            return None
        reason = _check(raw, block_hash, token_ids, self.block_bytes)
        if reason is not None:
            logger.warning("KV disk tier: %s failed its check (%s); deleted", path.name, reason)
            self.errors[reason] += 1
            self._forget(block_hash, path)
            return None
        with self.lock:
            if block_hash in self.entries:
                self.entries.move_to_end(block_hash)
        return raw[_HEADER.size + 8 * len(token_ids):]

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every block queued so far is written (or timeout_s passes)."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return
        done.wait(timeout_s)

    # -- the writer thread -----------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            block_hash, token_ids, data = item
            path = self.path(block_hash)
            # (engines may share the directory: each writes its own temporary file)
            tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
            try:
                tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
                header = _HEADER.pack(_MAGIC, block_hash, zlib.crc32(data), len(data),
                                      len(token_ids))
                with open(tmp, "wb") as f:
                    f.write(header + tokens + data)
                os.replace(tmp, path)
            except Exception as e:  # (a full disk, a directory gone): this block is lost
                logger.warning("KV disk tier: writing %s failed: %s", path.name, e)
                self.errors["disk_write"] += 1
                tmp.unlink(missing_ok=True)
                continue
            size = _HEADER.size + len(tokens) + len(data)
            with self.lock:
                self.nbytes += size - self.entries.pop(block_hash, 0)
                self.entries[block_hash] = size
            self._trim()

    def _trim(self) -> None:
        while True:
            with self.lock:
                if self.nbytes <= self.budget_bytes or not self.entries:
                    return
                block_hash, size = self.entries.popitem(last=False)
                self.nbytes -= size
            try:
                self.path(block_hash).unlink()
            except OSError:
                pass

    def _forget(self, block_hash: bytes, path: Optional[Path]) -> None:
        with self.lock:
            self.nbytes -= self.entries.pop(block_hash, 0)
        if path is not None:
            try:
                path.unlink()
            except OSError:
                pass


def _check(raw: bytes, block_hash: bytes, token_ids: Tokens, block_bytes: Optional[int]
           ) -> Optional[str]:
    """Why a disk block's file is not this block's, or None."""
    if len(raw) < _HEADER.size:
        return "disk_size"
    magic, stored_hash, crc, size, num_tokens = _HEADER.unpack_from(raw)
    if magic != _MAGIC or size != (size if block_bytes is None else block_bytes):
        return "disk_size"
    if len(raw) != _HEADER.size + 8 * num_tokens + size:
        return "disk_size"
    if stored_hash != block_hash:
        return "disk_hash"
    if struct.unpack_from(f"<{num_tokens}q", raw, _HEADER.size) != token_ids:
        return "disk_tokens"
    if zlib.crc32(memoryview(raw)[-size:]) != crc:
        return "disk_checksum"
    return None
