"""Prompt KV moved between engines (prefill/decode disaggregation), failing closed.

Model: a prefill engine computes a request's prompt and its first token; a decode
engine continues the request. The KV both need is the prompt's, in full blocks named
by the chained hashes both engines' prefix caches already use (common/prefix_hash.py),
so a transferred block is, on the decode engine, just a prefix-cache block that arrived
over the network instead of being computed:

  * Prefill side (``KvLeases``): a request added with ``kv_lease_s`` keeps its prompt's
    full blocks referenced when it ends (so they are not evicted) until the decode
    engine's last pull releases them (a transfer that ends early or is aborted sends a
    pull for nothing that does) or the lease expires. A pull is answered from the
    prefix cache by hash, in order, stopping at the first block not held.
  * Decode side (``KvReceiver``): a request added with a ``kv_source`` looks up its
    prompt's full blocks in its own prefix cache first and pulls only the rest. Each
    arriving block must be the next one asked for, carry the hash this engine computed
    from its own token ids, have exactly a block's size and match its CRC-32; only then
    are its bytes written into a block reserved for it and registered in the prefix
    cache. On the first block that fails, a deadline passed, the source's error or its
    death, the transfer ends early. Either way the request then joins the scheduler's
    queue like any other: its admission attaches whatever verified blocks the cache
    holds and computes the rest (at least the last prompt token: the scheduler always
    recomputes it). So no token is ever sampled from KV that was not verified, and a
    failed transfer costs time, never correctness.

Bounds: a pull asks for at most ``window_bytes`` of blocks, and pulls are issued only
while the bytes asked for and not yet received, over all transfers, stay within
``max_inflight_bytes``. Reserved blocks come from the free pool without evicting
anything still referenced; a pool too full to reserve them pulls fewer (down to
none, computing the prompt instead).
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from common.protocol import KvBlock, KvBlocks, KvPull, KvSource
from engine_worker.block_manager import BlockManager, BlockTable
from engine_worker.kv_scales import UNCALIBRATED, KvScales
from engine_worker.ops import FP8, value_blocks
from engine_worker.request import Request


def checksum(data: bytes) -> int:
    """CRC-32 (zlib: about 3 GB/s here), enough to catch a flipped or lost byte;
    which block a payload is comes from its chained hash."""
    return zlib.crc32(data)


class KvBlockStore:
    """One engine's KV cache seen as blocks of bytes: every layer's keys, then values."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], name: str,
                 scales: Optional[KvScales] = None) -> None:
        """scales: an fp8 cache's (kv_scales.py), which a peer's blocks must share."""
        # Each layer's cache is (2, num_blocks, block_size, H_kv, D) (attention.py).
        self.kv_caches = list(kv_caches)
        first = self.kv_caches[0]
        _, _, block_size, heads, head_dim = first.shape
        self.block_bytes = (len(self.kv_caches) * 2 * block_size * heads * head_dim
                            * first.element_size())
        self._layout = (f"{name}|{first.dtype}|layers={len(self.kv_caches)}|"
                        f"block={block_size}|kv_heads={heads}|head_dim={head_dim}|"
                        f"values={tuple(value_blocks(first).shape[1:])}")
        self.scales = scales

    @property
    def layout(self) -> str:
        """What a peer's block bytes must mean to be usable here."""
        if self.scales is None:
            return self._layout
        return f"{self._layout}|{self.scales.signature()}"

    @property
    def settled(self) -> bool:
        """Whether the layout is final (an fp8 cache's scales are set): blocks kept
        beyond this engine's life are kept under it."""
        return self.scales is None or self.scales.signature() != UNCALIBRATED

    def serves(self, layout: str) -> bool:
        """Whether this engine's blocks are of use to a peer of ``layout``: the same,
        or (an fp8 cache) the same but for scales the peer has not set yet, which it
        takes with the blocks (KvBlocks.kv_scales)."""
        return layout == self.layout or (
            self.scales is not None and layout == f"{self._layout}|{UNCALIBRATED}")

    def read(self, block_id: int) -> bytes:
        return self.read_rows([block_id]).cpu().numpy().tobytes()

    def write(self, block_id: int, data: bytes) -> None:
        self.write_rows([block_id], torch.frombuffer(bytearray(data), dtype=torch.uint8)
                        .view(1, -1))

    def read_rows(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' bytes, (len(block_ids), block_bytes) uint8 on the cache's device:
        each row every layer's keys then values, layer by layer."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv_caches[0].device)
        return torch.cat([c.view(torch.uint8)[:, ids].movedim(1, 0).reshape(len(ids), -1)
                          for c in self.kv_caches], dim=1)

    def write_rows(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Write rows of block bytes (read_rows' layout, on any device) into the blocks."""
        first = self.kv_caches[0]
        rows = rows.to(first.device)
        if first.dtype == FP8:  # an fp8 cache holds no NaN (ops.to_cache_dtype): made 0
            rows = rows.masked_fill((rows & 0x7F) == 0x7F, 0)
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
        per_layer = rows.shape[1] // len(self.kv_caches)
        for i, cache in enumerate(self.kv_caches):
            raw = cache.view(torch.uint8)
            layer = rows[:, i * per_layer:(i + 1) * per_layer]
            raw[:, ids] = layer.reshape(len(ids), *raw[:, 0].shape).movedim(0, 1)


@dataclass
class _Lease:
    table: BlockTable
    expires_at: float


class KvLeases:
    """The prefill side: blocks held for decode engines, and pulls answered."""

    def __init__(self, block_manager: BlockManager, store: KvBlockStore) -> None:
        self.block_manager = block_manager
        self.store = store
        self.leases: dict[str, _Lease] = {}
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0

    def hold(self, request: Request, lease_s: float, now: float) -> None:
        """Keep the request's prompt blocks (those the prefix cache holds) for lease_s."""
        bm = self.block_manager
        num_full = bm.hash_blocks(request.blocks, request.token_ids, request.num_prompt_tokens)
        held = []
        for block_hash in request.blocks.block_hashes[:num_full]:
            block_id = bm.lookup(block_hash)
            if block_id is None:
                break
            held.append(block_id)
        self.release(request.request_id)
        if held:  # a prompt shorter than a block leaves nothing to pull
            self.leases[request.request_id] = _Lease(bm.hold(held), now + lease_s)

    def release(self, request_id: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self.block_manager.free(lease.table)

    def expire(self, now: float) -> None:
        for request_id, lease in list(self.leases.items()):
            if now >= lease.expires_at:
                self.release(request_id)

    def answer(self, pull: KvPull, window_bytes: int) -> KvBlocks:
        """The blocks a pull asks for that this engine holds, in order, at most
        window_bytes of them."""
        if not self.store.serves(pull.layout):  # of no use to that engine: let go
            self.release(pull.request_id)
            return KvBlocks(request_id=pull.request_id, error=(
                f"KV layout mismatch: the decode engine has {pull.layout}, this prefill "
                f"engine {self.store.layout}"))
        blocks: list[KvBlock] = []
        error = None
        limit = max(1, window_bytes // self.store.block_bytes)
        for block_hash in pull.hashes[:limit]:
            block_id = self.block_manager.lookup(block_hash)
            if block_id is None:
                error = "the prefill engine no longer holds the block"
                break
            data = self.store.read(block_id)
            blocks.append(KvBlock(block_hash, checksum(data), data))
        self.num_blocks_sent += len(blocks)
        self.num_bytes_sent += len(blocks) * self.store.block_bytes
        if error is not None or (pull.release and len(blocks) == len(pull.hashes)):
            self.release(pull.request_id)
        scales = self.store.scales
        return KvBlocks(request_id=pull.request_id, blocks=blocks, error=error,
                        kv_scales=scales.values() if scales is not None and blocks else None)


@dataclass
class KvTransfer:
    """One request's pull, on the decode side."""

    request: Request
    source: KvSource
    # The prompt's block index of the first block pulled (the ones before it were
    # cached here), the chained hashes to pull, in prompt order, and the block
    # reserved for each.
    first_block: int
    hashes: list[bytes]
    staged: BlockTable
    # the request's cached prefix, held until its admission
    held: BlockTable
    deadline: float
    started: float
    # Blocks received and verified; blocks asked for beyond those, and how many each
    # pull not yet answered asked for (answers come in order, on one connection).
    num_done: int = 0
    num_asked: int = 0
    num_bytes: int = 0
    unanswered: deque = field(default_factory=deque)
    # Answers still to come to pulls given up on (after a short answer, the rest
    # is asked for again): dropped as they arrive.
    num_stale: int = 0
    # Set when it ended: "complete", or why it ended early.
    outcome: Optional[str] = None
    finished: Optional[float] = None


@dataclass
class KvStats:
    num_transfers: int = 0
    num_blocks_received: int = 0
    num_bytes_received: int = 0
    # Prompt blocks this engine already held, so not pulled.
    num_blocks_skipped: int = 0
    transfer_seconds: float = 0.0
    # Transfers that ended early (the rest computed here), by reason.
    fallbacks: Counter = field(default_factory=Counter)


class KvReceiver:
    """The decode side: transfers in flight, the pulls to send, blocks verified in."""

    def __init__(self, block_manager: BlockManager, store: KvBlockStore, timeout_s: float,
                 window_bytes: int, max_inflight_bytes: int, scales_sent: bool = True
                 ) -> None:
        """scales_sent: an fp8 cache's blocks come with the scales they were written
        with (a prefill engine's do; the KV store's are kept under a layout that names
        them, so they are this engine's)."""
        self.scales_sent = scales_sent
        self.block_manager = block_manager
        self.store = store
        self.timeout_s = timeout_s
        self.window_blocks = max(1, window_bytes // store.block_bytes)
        self.max_inflight_blocks = max(self.window_blocks,
                                       max_inflight_bytes // store.block_bytes)
        self.transfers: dict[str, KvTransfer] = {}
        # Transfers that ended before their last pull: the source is told to let go
        # of the lease (a KvPull asking for nothing, with release set).
        self._releases: list[tuple[str, KvPull]] = []
        self.stats = KvStats()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.transfers

    @property
    def num_inflight_blocks(self) -> int:
        return sum(t.num_asked - t.num_done for t in self.transfers.values())

    def next_deadline(self) -> Optional[float]:
        return min((t.deadline for t in self.transfers.values()), default=None)

    def start(self, request: Request, source: KvSource, now: float, skip: int = 0,
              cached: Optional[list[int]] = None) -> bool:
        """Begin pulling the prompt blocks this engine lacks (beyond the ``skip``
        blocks after its cached prefix, which it has elsewhere); False when there is
        nothing to pull (or no room to receive it): schedule the request now.
        ``cached``: the cached prefix, where the caller has looked it up already."""
        bm = self.block_manager
        if cached is None:
            cached = bm.find_cached_prefix(request.blocks, request.token_ids)
        first = len(cached) + skip
        # find_cached_prefix hashed every full block before the last token, which
        # for a continued request is exactly the prompt's full blocks.
        wanted = request.blocks.block_hashes[first:]
        self.stats.num_blocks_skipped += first
        # Room for the rest of the request's first step, beyond the pulled blocks.
        tail = bm.blocks_for(request.num_tokens) - len(request.blocks.block_hashes) + 1
        # The cached prefix is held until the request's admission: evicted meanwhile (by
        # this reserve, or by other requests while the blocks arrive), the blocks
        # pulled after it would be of no use.
        held = bm.hold(cached)
        staged = bm.reserve(min(len(wanted), bm.num_free_blocks - tail))
        if not staged.block_ids:
            bm.free(held)
            return False
        self.stats.num_transfers += 1
        self.transfers[request.request_id] = KvTransfer(
            request, source, first, wanted[:len(staged.block_ids)], staged, held,
            deadline=now + self.timeout_s, started=now)
        return True

    def pulls(self) -> list[tuple[str, KvPull]]:
        """(address, KvPull) for every transfer that may ask for more now, and the
        releases of leases no longer needed."""
        out, self._releases = self._releases, []
        budget = self.max_inflight_blocks - self.num_inflight_blocks
        # A window at a time for each transfer in turn, while the bound on blocks in
        # flight allows: a busy source answers every pull waiting between its steps.
        wanting = [t for t in self.transfers.values() if t.num_asked < len(t.hashes)]
        while wanting and budget > 0:
            for t in wanting:
                n = min(self.window_blocks, len(t.hashes) - t.num_asked, budget)
                if n <= 0:
                    break
                hashes = t.hashes[t.num_asked:t.num_asked + n]
                t.num_asked += n
                t.unanswered.append(n)
                budget -= n
                out.append((t.source.address, KvPull(
                    request_id=t.source.request_id, hashes=hashes, layout=self.store.layout,
                    release=t.num_asked == len(t.hashes))))
            wanting = [t for t in wanting if t.num_asked < len(t.hashes)]
        return out

    def receive(self, address: str, reply: KvBlocks, now: float) -> list[KvTransfer]:
        """Verify and store a reply's blocks; the transfers it ended."""
        t = self._find(address, reply.request_id)
        if t is None:
            return []  # ended already (deadline, abort): its late blocks are dropped
        if t.num_stale:
            t.num_stale -= 1
            return []
        if not t.unanswered or len(reply.blocks) > t.unanswered[0]:
            return [self._end(t, "protocol", now)]  # more than was asked for
        asked = t.unanswered.popleft()
        scales = self.store.scales
        if (reply.blocks and scales is not None and self.scales_sent
                and not scales.adopt(reply.kv_scales or [])):
            return [self._end(t, "source", now)]   # written with other scales
        for block in reply.blocks:
            reason = self._store(t, block)
            if reason is not None:
                return [self._end(t, reason, now)]
        if reply.error is not None:
            return [self._end(t, "source", now)]
        if t.num_done == len(t.hashes):
            return [self._end(t, "complete", now)]
        if len(reply.blocks) < asked:
            # Fewer than asked and no error (the source's window is smaller): the
            # answers to later pulls would not follow on; drop them, ask again.
            t.num_stale, t.num_asked = len(t.unanswered), t.num_done
            t.unanswered.clear()
        return []

    def expire(self, now: float) -> list[KvTransfer]:
        return [self._end(t, "deadline", now) for t in list(self.transfers.values())
                if now >= t.deadline]

    def fail_source(self, address: str, reason: str, now: float) -> list[KvTransfer]:
        """The source is gone (disconnected, dead): its transfers end now."""
        return [self._end(t, reason, now) for t in list(self.transfers.values())
                if t.source.address == address]

    def cancel(self, request_id: str) -> bool:
        """An aborted request: its transfer ends and every reserved block is freed."""
        t = self.transfers.pop(request_id, None)
        if t is None:
            return False
        self.block_manager.free(t.staged)
        self.block_manager.free(t.held)
        self._release(t)
        return True

    # -- internals -------------------------------------------------------------

    def _find(self, address: str, source_request_id: str) -> Optional[KvTransfer]:
        for t in self.transfers.values():
            if t.source.address == address and t.source.request_id == source_request_id:
                return t
        return None

    def _store(self, t: KvTransfer, block: KvBlock) -> Optional[str]:
        """Verify one block and write it into its reserved block; why not, if not."""
        i = t.num_done
        if block.block_hash != t.hashes[i]:
            return "hash"
        if len(block.data) != self.store.block_bytes:
            return "size"
        if checksum(block.data) != block.checksum:
            return "checksum"
        block_id = t.staged.block_ids[i]
        self.store.write(block_id, block.data)
        bs = self.block_manager.block_size
        start = (t.first_block + i) * bs
        self.block_manager.register(block_id, block.block_hash,
                                    t.request.token_ids[start:start + bs])
        t.num_done += 1
        t.num_bytes += len(block.data)
        return None

    def _end(self, t: KvTransfer, outcome: str, now: float) -> KvTransfer:
        """Stop the transfer; the blocks not filled go back to the pool. The filled
        ones stay referenced by ``t.staged`` until the request is admitted
        (Scheduler: ``Request.staged_blocks``)."""
        del self.transfers[t.request.request_id]
        t.outcome, t.finished = outcome, now
        unfilled = BlockTable(block_ids=t.staged.block_ids[t.num_done:])
        del t.staged.block_ids[t.num_done:]
        self.block_manager.free(unfilled)
        s = self.stats
        s.num_blocks_received += t.num_done
        s.num_bytes_received += t.num_bytes
        s.transfer_seconds += now - t.started
        if outcome != "complete":
            s.fallbacks[outcome] += 1
            if outcome not in ("source", "disconnected", "source_dead"):
                self._release(t)  # the source is alive and may still hold the lease
        t.staged.block_ids[:0] = t.held.block_ids   # (admission lets go of both)
        t.held.block_ids.clear()
        t.request.staged_blocks = t.staged
        return t

    def _release(self, t: KvTransfer) -> None:
        if t.num_asked < len(t.hashes) or t.num_done < t.num_asked:
            self._releases.append((t.source.address, KvPull(
                request_id=t.source.request_id, hashes=[], layout=self.store.layout,
                release=True)))
