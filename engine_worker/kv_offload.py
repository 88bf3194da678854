"""Tiers below the KV pool: blocks evicted from it kept in host memory and on local
disk, and copied back when a later request's prompt needs them instead of computed.

Model: a cached block the pool evicts (block_manager.py: ``on_evict``, told before
anything is written into it) is copied, as bytes in the cache's own dtype
(KvBlockStore's rows), into the first tier below:

  * the host tier (``--kv-offload-memory GIB``, ``HostTier``): a slab of host memory
    cut into block-sized slots, least recently used first out; pinned where the pool
    is on a GPU, its copies on a side stream the step's stream waits for, so that no
    copy holds up the host. On the CPU the pool is host memory already: the tier adds
    room for more blocks, copied back in microseconds where recomputing them costs
    milliseconds;
  * the disk tier (``--kv-offload-dir DIR``, ``DiskTier``): a file a block under a
    directory named by the KV layout, written by a thread of its own (a full queue
    drops the block: it is a cache), least recently used first out past its budget,
    and found again by an engine that restarts on the same directory. The host tier's
    evicted slots go there; without a host tier, the pool's do.

On admission (Scheduler: ``onload``) a request's prompt blocks beyond what the pool
holds are looked up tier by tier, in prompt order; the leading run found is copied
into fresh blocks, registered in the prefix cache and attached as if they had been
cached, the rest computed. Keys are the prefix cache's chained hashes, and every
entry also keeps its token ids, compared on the way back; a block read from disk is
checked (its layout's directory, hash, token ids, size, CRC-32) and a bad one is
deleted and computed instead. A tier fault costs recomputation, never a wrong token.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from engine_worker.block_manager import BlockManager, BlockTable, Evicted
from engine_worker.kv_transfer import KvBlockStore
from engine_worker.request import Request

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]


@dataclass
class OffloadStats:
    # Blocks copied into each tier, and copied back from it into the pool.
    stored: Counter = field(default_factory=Counter)
    loaded: Counter = field(default_factory=Counter)
    # Prompt blocks looked up below the pool and found nowhere (computed).
    missed: int = 0
    # Blocks refused or lost, by why (a disk block that failed its checks, a write
    # that failed or found its queue full).
    errors: Counter = field(default_factory=Counter)


class HostTier:
    """Evicted blocks' bytes in host memory: a slot a block, least recently used first
    out, a byte budget."""

    def __init__(self, budget_bytes: int, block_bytes: int, pin: bool) -> None:
        self.num_slots = budget_bytes // block_bytes
        if self.num_slots < 1:
            raise ValueError(f"a KV offload budget of {budget_bytes} bytes holds no block of "
                             f"{block_bytes} bytes")
        self.block_bytes = block_bytes
        self.slab = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8,
                                pin_memory=pin)
        # hash -> (slot, token ids), least recently used first
        self.entries: OrderedDict[bytes, tuple[int, Tokens]] = OrderedDict()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return len(self.entries) * self.block_bytes

    def find(self, block_hash: bytes, token_ids: Tokens) -> Optional[int]:
        """The slot holding this block (now the most recently used), or None."""
        entry = self.entries.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return None
        self.entries.move_to_end(block_hash)
        return entry[0]

    def slot_for(self, block_hash: bytes, token_ids: Tokens
                 ) -> tuple[int, Optional[tuple[bytes, Tokens]]]:
        """A slot for a new block, and the entry it pushed out (least recently used;
        its bytes are still in the slot until the caller writes there)."""
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            old_hash, (slot, old_tokens) = self.entries.popitem(last=False)
            victim = (old_hash, old_tokens)
        self.entries[block_hash] = (slot, token_ids)
        return slot, victim


_MAGIC = b"RSKV1\0"
_HEADER = struct.Struct("<6s16sIQI")  # magic, hash, CRC-32, data bytes, token count


class DiskTier:
    """Evicted blocks in files, one a block, under a directory of the KV layout's;
    least recently used first out past a byte budget. Written by a thread of its own;
    read, and checked, by the caller."""

    # Blocks waiting for the writer: beyond these, a block is dropped.
    QUEUE_BLOCKS = 256

    def __init__(self, root: str, layout: str, budget_bytes: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.budget_bytes = budget_bytes
        self.dir = Path(root) / hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()
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

    def put(self, block_hash: bytes, token_ids: Tokens, data: bytes) -> None:
        """Queue a block for writing (dropped, and counted, when the writer is behind)."""
        with self.lock:
            if block_hash in self.entries:
                self.entries.move_to_end(block_hash)
                return
        try:
            self._queue.put_nowait((block_hash, token_ids, data))
        except queue.Full:
            self.errors["disk_queue_full"] += 1

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
        return raw[-self.block_bytes:]

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every block queued so far is written (or timeout_s passes)."""
        done = threading.Event()
        self._queue.put(done)
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
            tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
            header = _HEADER.pack(_MAGIC, block_hash, zlib.crc32(data), len(data),
                                  len(token_ids))
            # (engines may share the directory: each writes its own temporary file)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(header + tokens + data)
                os.replace(tmp, path)
            except OSError as e:
                logger.warning("KV disk tier: writing %s failed: %s", path.name, e)
                self.errors["disk_write"] += 1
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


def _check(raw: bytes, block_hash: bytes, token_ids: Tokens, block_bytes: int
           ) -> Optional[str]:
    """Why a disk block's file is not this block's, or None."""
    if len(raw) < _HEADER.size:
        return "disk_size"
    magic, stored_hash, crc, size, num_tokens = _HEADER.unpack_from(raw)
    if magic != _MAGIC or size != block_bytes:
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


class KvOffload:
    """The tiers below one engine's pool: blocks in as the pool evicts them, back out
    on admission."""

    def __init__(self, block_manager: BlockManager, store: KvBlockStore,
                 host_bytes: Optional[int], disk_dir: Optional[str], disk_bytes: int) -> None:
        self.block_manager = block_manager
        self.store = store
        device = store.kv_caches[0].device
        self.device = device
        self.host = (HostTier(host_bytes, store.block_bytes, pin=device.type == "cuda")
                     if host_bytes else None)
        self.disk = (DiskTier(disk_dir, store.layout, disk_bytes, store.block_bytes)
                     if disk_dir else None)
        self.stats = OffloadStats()
        # CUDA: the tiers' copies run here; the step's stream waits for them.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        block_manager.on_evict = self.evicted

    # -- into the tiers --------------------------------------------------------

    def evicted(self, blocks: list[Evicted]) -> None:
        """Keep the bytes of blocks the pool is about to reuse."""
        new = [b for b in blocks if not self._touch(b[1])]
        if not new:
            return
        with self._copies():
            rows = self.store.read_rows([b[0] for b in new])
            if self.host is None:
                assert self.disk is not None
                host_rows = rows.cpu()
                for (_, block_hash, tokens), row in zip(new, host_rows):
                    self.disk.put(block_hash, tokens, row.numpy().tobytes())
                self.stats.stored["disk"] += len(new)
                return
            for (_, block_hash, tokens), row in zip(new, rows):
                slot, victim = self.host.slot_for(block_hash, tokens)
                if victim is not None and self.disk is not None:
                    self._sync()   # the victim's bytes reached the slab
                    self.disk.put(victim[0], victim[1], self.host.slab[slot].numpy().tobytes())
                    self.stats.stored["disk"] += 1
                self.host.slab[slot].copy_(row, non_blocking=True)
            self.stats.stored["host"] += len(new)

    def persist(self, timeout_s: float = 30.0) -> int:
        """Write every block the pool and the host tier hold to the disk tier (an engine
        that stops leaves its cache for the next one on the same directory); how many
        were queued."""
        if self.disk is None:
            return 0
        bm = self.block_manager
        cached = []
        for block_hash in bm.cached_hashes():
            block = bm.blocks[bm.lookup(block_hash)]
            assert block.token_ids is not None
            cached.append((block_hash, block.token_ids, block.block_id))
        count = 0
        with self._copies():
            for start in range(0, len(cached), 64):
                part = cached[start:start + 64]
                rows = self.store.read_rows([i for _, _, i in part]).cpu()
                for (block_hash, tokens, _), row in zip(part, rows):
                    self.disk.put(block_hash, tokens, row.numpy().tobytes())
                count += len(part)
        if self.host is not None:
            self._sync()
            for block_hash, (slot, tokens) in self.host.entries.items():
                self.disk.put(block_hash, tokens, self.host.slab[slot].numpy().tobytes())
                count += 1
        self.disk.flush(timeout_s)
        return count

    # -- back into the pool ------------------------------------------------------

    def onload(self, request: Request, cached: list[int]) -> Optional[BlockTable]:
        """Copy the prompt blocks after ``cached`` (the pool's hits) that the tiers hold,
        the leading run of them, into fresh blocks registered in the prefix cache; the
        table holding them (``free`` it once the request has attached them), or None
        when no block was."""
        bm, bs = self.block_manager, self.block_manager.block_size
        token_ids, hashes = request.token_ids, request.blocks.block_hashes
        num_full = (len(token_ids) - 1) // bs   # the last token is always computed
        wanted: list[int] = []
        for i in range(len(cached), num_full):
            if not self._holds(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])):
                break
            wanted.append(i)
        self.stats.missed += num_full - len(cached) - len(wanted)
        if not wanted:
            return None
        held = bm.hold(cached)   # not evicted to make room for the rest
        # room for the rest of the request's first step, beyond the blocks copied back
        tail = bm.blocks_for(request.num_tokens) - num_full + 1
        staged = bm.reserve(min(len(wanted), bm.num_free_blocks - tail))
        filled = self._load(staged.block_ids, wanted, hashes, token_ids)
        self.stats.missed += len(wanted) - filled
        bm.free(BlockTable(block_ids=staged.block_ids[filled:]))
        del staged.block_ids[filled:]
        bm.free(held)
        if not filled:
            return None
        return staged

    def _load(self, block_ids: list[int], wanted: list[int], hashes: Sequence[bytes],
              token_ids: Sequence[int]) -> int:
        """Copy the wanted blocks, in order, into ``block_ids`` and register them; stops
        at the first one no tier gives back. How many were."""
        bm, bs = self.block_manager, self.block_manager.block_size
        sources: list[torch.Tensor] = []   # slab rows, or disk blocks (checked)
        tiers: list[str] = []
        for i in wanted[:len(block_ids)]:
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            slot = self.host.find(hashes[i], tokens) if self.host is not None else None
            if slot is not None:
                assert self.host is not None
                sources.append(self.host.slab[slot])
                tiers.append("host")
                continue
            data = self.disk.get(hashes[i], tokens) if self.disk is not None else None
            if data is None:
                break
            sources.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            tiers.append("disk")
        if not sources:
            return 0
        with self._copies():
            rows = torch.empty((len(sources), self.store.block_bytes), dtype=torch.uint8,
                               device=self.device)
            for row, source in zip(rows, sources):
                row.copy_(source, non_blocking=True)
            self.store.write_rows(block_ids[:len(sources)], rows)
        for block_id, i in zip(block_ids, wanted[:len(sources)]):
            bm.register(block_id, hashes[i], token_ids[i * bs:(i + 1) * bs])
        self.stats.loaded.update(tiers)
        return len(sources)

    # -- internals ---------------------------------------------------------------

    def _touch(self, block_hash: bytes) -> bool:
        """Whether the first tier holds the block already (now most recently used)."""
        if self.host is not None:
            entry = self.host.entries.get(block_hash)
            if entry is not None:
                self.host.entries.move_to_end(block_hash)
            return entry is not None
        assert self.disk is not None
        return self.disk.holds(block_hash)

    def _holds(self, block_hash: bytes, tokens: Tokens) -> bool:
        if self.host is not None:
            entry = self.host.entries.get(block_hash)
            if entry is not None and entry[1] == tokens:
                self.host.entries.move_to_end(block_hash)
                return True
        return self.disk is not None and self.disk.holds(block_hash)

    @contextmanager
    def _copies(self) -> Iterator[None]:
        """CUDA: the copies inside run on the side stream, after the work the step's
        stream has queued (a block's last write), and the step's stream waits for them
        before its next work (the block's next write); the host waits for neither."""
        if self._stream is None:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            yield
        main.wait_stream(self._stream)

    def _sync(self) -> None:
        """The host is about to read the slab: the copies into it are done."""
        if self._stream is not None:
            self._stream.synchronize()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Blocks and bytes each tier holds now."""
        held: dict[str, dict[str, int]] = {"blocks": {}, "bytes": {}}
        if self.host is not None:
            held["blocks"]["host"], held["bytes"]["host"] = len(self.host), self.host.nbytes
        if self.disk is not None:
            held["blocks"]["disk"], held["bytes"]["disk"] = len(self.disk), self.disk.nbytes
        return held

    def errors(self) -> dict[str, int]:
        errors = Counter(self.stats.errors)
        if self.disk is not None:
            errors.update(self.disk.errors)
        return dict(errors)
