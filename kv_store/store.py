"""The shared KV store's contents: blocks by (KV layout, chained hash).

Model: engines put the full blocks their pools evict or their requests fill (KvPut),
each named by the prefix cache's chained hash (common/prefix_hash.py) and tagged with
its KV layout (model, dtype, block size, layer count and shapes:
KvBlockStore.layout); engines pull the leading blocks of a prompt they lack (KvPull).
A block is kept only when its CRC-32 matches and its size is its layout's (the size
of the layout's first block); a pull of one layout never sees another's blocks. Held
in memory up to a byte budget, least recently used first out, to a disk tier per
layout (common/kv_disk.py) when one is given; a block found on disk comes back into
memory.
"""

from __future__ import annotations

import zlib
from collections import Counter, OrderedDict
from typing import Optional

from common.kv_disk import DiskTier, layout_dir
from common.protocol import KvBlock, StoreStats

# A layout's name is a few hundred characters (KvBlockStore.layout); a hash 16 bytes.
MAX_LAYOUT_CHARS = 4096
HASH_BYTES = 16
# Layouts (models, dtypes, block sizes...) kept at once; a put of another is refused.
MAX_LAYOUTS = 64


class BlockStore:
    def __init__(self, memory_bytes: int, disk_dir: Optional[str] = None,
                 disk_bytes: int = 0) -> None:
        self.memory_bytes = memory_bytes
        self.disk_dir, self.disk_bytes = disk_dir, disk_bytes
        # (layout, hash) -> block, least recently used first
        self.entries: OrderedDict[tuple[str, bytes], KvBlock] = OrderedDict()
        self.nbytes = 0
        self.block_bytes: dict[str, int] = {}   # each layout's, as its first block's
        self.disks: dict[str, DiskTier] = {}
        self.num_put = self.num_hits = self.num_misses = 0
        self.refused: Counter = Counter()

    def put(self, layout: str, block: KvBlock) -> Optional[str]:
        """Keep a block; why not, if not."""
        if not layout or len(layout) > MAX_LAYOUT_CHARS or (
                layout not in self.block_bytes and len(self.block_bytes) >= MAX_LAYOUTS):
            return self._refuse("layout")
        if len(block.block_hash) != HASH_BYTES:
            return self._refuse("hash")
        size = self.block_bytes.setdefault(layout, len(block.data))
        if len(block.data) != size or size > self.memory_bytes:
            return self._refuse("size")
        if zlib.crc32(block.data) != block.checksum:
            return self._refuse("checksum")
        key = (layout, block.block_hash)
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= len(old.data)
        self.entries[key] = block
        self.nbytes += size
        self.num_put += 1
        self._trim()
        return None

    def get(self, layout: str, block_hash: bytes) -> Optional[KvBlock]:
        """The block, from memory or disk (then in memory again), or None."""
        key = (layout, block_hash)
        block = self.entries.get(key)
        if block is not None:
            self.entries.move_to_end(key)
        elif self.disk_dir is not None and (layout in self.disks or (
                len(layout) <= MAX_LAYOUT_CHARS and layout_dir(self.disk_dir, layout).is_dir())):
            data = self._disk(layout).get(block_hash, ())
            if data is not None:
                block = KvBlock(block_hash, zlib.crc32(data), data)
                self.entries[key] = block
                self.nbytes += len(data)
                self._trim()
        if block is None:
            self.num_misses += 1
        else:
            self.num_hits += 1
        return block

    def stats(self) -> StoreStats:
        blocks, data = {"memory": len(self.entries)}, {"memory": self.nbytes}
        if self.disk_dir is not None:
            blocks["disk"] = sum(len(d) for d in self.disks.values())
            data["disk"] = sum(d.nbytes for d in self.disks.values())
        refused = Counter(self.refused)
        for disk in self.disks.values():
            refused.update(disk.errors)
        return StoreStats(blocks=blocks, bytes=data, num_put=self.num_put,
                          num_hits=self.num_hits, num_misses=self.num_misses,
                          refused=dict(refused))

    def flush(self) -> None:
        """Everything in memory written to disk (a store that stops), if it has one."""
        if self.disk_dir is None:
            return
        for (layout, block_hash), block in self.entries.items():
            self._disk(layout).put(block_hash, (), block.data)
        for disk in self.disks.values():
            disk.flush()

    def _trim(self) -> None:
        while self.nbytes > self.memory_bytes:
            (layout, block_hash), block = self.entries.popitem(last=False)
            self.nbytes -= len(block.data)
            if self.disk_dir is not None:
                self._disk(layout).put(block_hash, (), block.data)

    def _disk(self, layout: str) -> DiskTier:
        disk = self.disks.get(layout)
        if disk is None:
            assert self.disk_dir is not None
            # (a layout's blocks are all of one size: its name says which)
            disk = self.disks[layout] = DiskTier(self.disk_dir, layout, self.disk_bytes, None)
        return disk

    def _refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason
