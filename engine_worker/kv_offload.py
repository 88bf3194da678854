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

The shared KV store (kv_store_link.py) gets the evicted blocks too, and those of every
request as they fill (a request that fails over to another engine is pulled there) and
as it ends. Where bytes must reach the host from a GPU (the disk, the store),
they are copied into pinned memory on the side stream and handed over by a later
``poll()`` (every step) once there; a host slot pushed out to disk before its own copy
has landed is dropped, not waited for. So the step's path never waits for a copy.

On admission (Scheduler: ``onload``) a request's prompt blocks beyond what the pool
holds are looked up tier by tier, in prompt order; the leading run found is copied
into fresh blocks, registered in the prefix cache and attached as if they had been
cached, the rest computed. Keys are the prefix cache's chained hashes, and every
entry also keeps its token ids, compared on the way back; a block read from disk is
checked (its layout's directory, hash, token ids, size, CRC-32) and a bad one is
deleted and computed instead. A tier fault costs recomputation, never a wrong token.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from common.kv_disk import DiskTier, Tokens
from engine_worker.block_manager import BlockManager, BlockTable, Evicted
from engine_worker.kv_store_link import KvStoreLink, request_blocks
from engine_worker.kv_transfer import KvBlockStore
from engine_worker.request import Request

logger = logging.getLogger(__name__)

# Blocks copied at a time: a temporary of this many blocks on the device, at most.
CHUNK_BLOCKS = 64



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


class KvOffload:
    """The tiers below one engine's pool: blocks in as the pool evicts them, back out
    on admission."""

    def __init__(self, block_manager: BlockManager, store: KvBlockStore,
                 host_bytes: Optional[int], disk_dir: Optional[str], disk_bytes: int,
                 link: Optional[KvStoreLink] = None) -> None:
        """link: the shared KV store's (kv_store_link.py), which evicted blocks and
        those of requests, as they fill and as they end, are put to."""
        self.block_manager = block_manager
        self.store = store
        device = store.kv_caches[0].device
        self.device = device
        self.host = (HostTier(host_bytes, store.block_bytes, pin=device.type == "cuda")
                     if host_bytes else None)
        self._disk_dir, self._disk_bytes = disk_dir, disk_bytes
        self._disk: Optional[DiskTier] = None
        self.link = link
        self.stats = OffloadStats()
        # CUDA: the tiers' copies run here; the step's stream waits for them. Copies to
        # the host under way (an event, the pinned rows, what takes their bytes), and
        # when each host slot's last copy is done.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._deferred: deque = deque()
        self._written: dict[int, torch.cuda.Event] = {}
        block_manager.on_evict = self.evicted

    @property
    def disk(self) -> Optional[DiskTier]:
        """The disk tier, made on first use under the KV layout as it is then: never
        while an fp8 cache's scales are not set (blocks written with one run's scales
        would be read with another's)."""
        if self._disk is None and self._disk_dir is not None and self.store.settled:
            self._disk = DiskTier(self._disk_dir, self.store.layout, self._disk_bytes,
                                  self.store.block_bytes)
        return self._disk

    # -- into the tiers --------------------------------------------------------

    def evicted(self, blocks: list[Evicted]) -> None:
        """Keep the bytes of blocks the pool is about to reuse. Never raises: a block
        not kept is computed when next needed."""
        try:
            for start in range(0, len(blocks), CHUNK_BLOCKS):   # bounded temporaries
                self._evicted(blocks[start:start + CHUNK_BLOCKS])
        except Exception as e:
            self._failed("evict", e)

    def _evicted(self, blocks: list[Evicted]) -> None:
        new = [b for b in blocks if not self._touch(b[1])]
        if self.link is not None:   # (the store is told even of blocks a tier holds)
            self._put([b[0] for b in blocks], [b[1] for b in blocks])
        disk = self.disk
        if not new or (self.host is None and disk is None):
            return
        with self._copies():
            rows = self.store.read_rows([b[0] for b in new])
            if self.host is None:
                assert disk is not None
                self._to_host(rows, lambda data: [disk.put(h, tokens, d) for (_, h, tokens), d
                                                  in zip(new, data)])
                self.stats.stored["disk"] += len(new)
                return
            slots = []
            for (_, block_hash, tokens), row in zip(new, rows):
                slot, victim = self.host.slot_for(block_hash, tokens)
                if victim is not None and disk is not None:
                    self._spill(slot, victim, disk)
                self.host.slab[slot].copy_(row, non_blocking=True)
                slots.append(slot)
            if self._stream is not None:   # when these slots' bytes are there
                done = self._stream.record_event()
                self._written.update((slot, done) for slot in slots)
            self.stats.stored["host"] += len(new)

    def _spill(self, slot: int, victim: tuple[bytes, Tokens], disk: DiskTier) -> None:
        """The host tier's least recently used block, about to be overwritten, to disk:
        only if its bytes are in the slot already (CUDA: the copy there may still be
        on its way, and the host does not wait; such a block is not kept)."""
        written = self._written.pop(slot, None)
        if written is not None and not written.query():
            self.stats.errors["spill_busy"] += 1
            return
        disk.put(victim[0], victim[1], self.host.slab[slot].numpy().tobytes())
        self.stats.stored["disk"] += 1

    def _to_host(self, rows: torch.Tensor, then: Callable[[list[bytes]], object]) -> None:
        """Hand the rows' bytes (a device tensor, inside _copies) to ``then`` once they
        are on the host, the host never waiting for the device: on CUDA they are copied
        into pinned memory on the side stream and handed over by the first poll() after
        the copy is done."""
        if self._stream is None:
            then([row.numpy().tobytes() for row in rows.cpu()])
            return
        pinned = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(rows, non_blocking=True)
        self._deferred.append((self._stream.record_event(), pinned, then))

    def poll(self) -> None:
        """Hand over the copies to the host that are done (CUDA: every step); never
        waits."""
        while self._deferred and self._deferred[0][0].query():
            _, pinned, then = self._deferred.popleft()
            try:
                then([row.numpy().tobytes() for row in pinned])
            except Exception as e:
                self._failed("put", e)

    def finished(self, request: Request) -> None:
        """A request ends: its blocks in the prefix cache go to the shared store. Never
        raises (the request has its tokens)."""
        if self.link is None:
            return
        try:
            self._put_all(*request_blocks(request))
        except Exception as e:
            self._failed("put", e)

    def running(self, requests: Iterable[Request]) -> None:
        """Running requests' blocks go to the shared store as they fill, so that a
        request whose engine dies continues on another (a failover) that pulls them
        rather than computing its prompt and output again. Never raises."""
        if self.link is None or not self._putting():
            return   # (what fills meanwhile goes when the request ends)
        try:
            named: dict[bytes, int] = {}   # (one copy of a block requests share)
            for request in requests:
                table = request.blocks
                if table.num_registered > table.num_offered:
                    block_ids, hashes = request_blocks(request)
                    start = max(table.num_offered - table.released, 0)
                    named.update(zip(hashes[start:], block_ids[start:]))
                    table.num_offered = table.num_registered
            if named:
                self._put_all(list(named.values()), list(named))
        except Exception as e:
            self._failed("put", e)

    def _put_all(self, block_ids: list[int], hashes: list[bytes]) -> None:
        for start in range(0, len(block_ids), CHUNK_BLOCKS):
            self._put(block_ids[start:start + CHUNK_BLOCKS], hashes[start:start + CHUNK_BLOCKS])

    def _putting(self) -> bool:
        """Whether blocks are put to the store now: it is up, and the layout final."""
        assert self.link is not None
        return self.link.up(time.monotonic()) and self.store.settled

    def _put(self, block_ids: list[int], hashes: list[bytes]) -> None:
        if not self._putting():
            return
        todo = self.link.unknown(hashes)
        if todo:
            link, named = self.link, [hashes[i] for i in todo]
            with self._copies():
                rows = self.store.read_rows([block_ids[i] for i in todo])
                self._to_host(rows, lambda data: link.put(list(zip(named, data))))

    def _failed(self, what: str, e: Exception) -> None:
        if not self.stats.errors[what]:
            logger.warning("KV offload: %s failed (%s: %s); the blocks are computed when "
                           "next needed", what, type(e).__name__, e)
        self.stats.errors[what] += 1

    def tier_run(self, request: Request, num_cached: int) -> int:
        """How many of the request's prompt blocks after its first ``num_cached`` the
        host and disk tiers hold, in a run."""
        bs, token_ids = self.block_manager.block_size, request.token_ids
        hashes = request.blocks.block_hashes
        n = 0
        for i in range(num_cached, (len(token_ids) - 1) // bs):
            if not self._holds(hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]), touch=False):
                break
            n += 1
        return n

    def persist(self, timeout_s: float = 30.0) -> int:
        """Write every block the pool and the host tier hold to the disk tier (an engine
        that stops leaves its cache for the next one on the same directory); how many
        were queued."""
        disk = self.disk
        if disk is None:
            return 0
        bm = self.block_manager
        cached = []
        for block_hash in bm.cached_hashes():
            block = bm.blocks[bm.lookup(block_hash)]
            assert block.token_ids is not None
            cached.append((block_hash, block.token_ids, block.block_id))
        count = 0
        with self._copies():
            for start in range(0, len(cached), CHUNK_BLOCKS):
                part = cached[start:start + CHUNK_BLOCKS]
                rows = self.store.read_rows([i for _, _, i in part]).cpu()
                for (block_hash, tokens, _), row in zip(part, rows):
                    count += disk.put(block_hash, tokens, row.numpy().tobytes(), wait_s=1.0)
        if self.host is not None:
            self._sync()
            for block_hash, (slot, tokens) in self.host.entries.items():
                count += disk.put(block_hash, tokens, self.host.slab[slot].numpy().tobytes(),
                                  wait_s=1.0)
        disk.flush(timeout_s)
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
            for start in range(0, len(sources), CHUNK_BLOCKS):   # bounded temporaries
                part = sources[start:start + CHUNK_BLOCKS]
                rows = torch.empty((len(part), self.store.block_bytes), dtype=torch.uint8,
                                   device=self.device)
                for row, source in zip(rows, part):
                    row.copy_(source, non_blocking=True)
                self.store.write_rows(block_ids[start:start + len(part)], rows)
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
        return self.disk is not None and self.disk.holds(block_hash)

    def _holds(self, block_hash: bytes, tokens: Tokens, touch: bool = True) -> bool:
        if self.host is not None:
            entry = self.host.entries.get(block_hash)
            if entry is not None and entry[1] == tokens:
                if touch:
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
        if self._disk_dir is not None:
            disk = self._disk
            held["blocks"]["disk"] = len(disk) if disk is not None else 0
            held["bytes"]["disk"] = disk.nbytes if disk is not None else 0
        return held

    def errors(self) -> dict[str, int]:
        errors = Counter(self.stats.errors)
        if self._disk is not None:
            errors.update(self._disk.errors)
        return dict(+errors)
