"""One engine's side of the shared KV store (kv_store/): blocks put, prompt blocks
pulled, and a store that fails left alone for a while.

Put: the blocks the pool evicts (kv_offload.py) and the full blocks of every request,
as they fill and as it ends, unless this engine put or pulled them lately (``known``), in KvPut frames of
at most PUT_FRAME_BYTES, sent by the I/O thread without waiting on a socket of their
own (a store that is not reading has them dropped: it is a cache; pulls are never
queued behind them).

Pull: a request that arrives with prompt blocks neither the pool nor the tiers below it
hold asks the store for the rest, through a KvReceiver of its own (kv_transfer.py), so
that every block is checked as a prefill engine's are (order, chained hash, size,
CRC-32) and the request waits at most ``timeout_s``; the store answers with the leading
blocks it holds and stops at the first it does not (a miss: the rest is computed).

Fails closed: a transfer that ends by its deadline, or a connection to the store that
drops, trips the link: nothing is pulled or put for a backoff (1 s, doubling to 30 s;
reset by the next answer), so a store that is down or slow costs each request at most
one deadline, and the engine serves on meanwhile. What the engine remembers as being in
the store is forgotten then too (a store that restarts may have come back empty).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Optional, Sequence

from common.protocol import KvBlock, KvBlocks, KvPut, KvSource, Ping, StorePong, StoreStats
from engine_worker.block_manager import BlockManager
from engine_worker.io_thread import PUT_CHANNEL
from engine_worker.kv_transfer import KvBlockStore, KvReceiver, KvTransfer, checksum
from engine_worker.request import Request

logger = logging.getLogger(__name__)

# A KvPut frame holds at most this many bytes of blocks (one block, where a block is
# more), well within any peer's frame limit.
PUT_FRAME_BYTES = 4 << 20
# How often the store is asked for its figures (a Ping; its StorePong).
PING_S = 5.0
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# Hashes remembered as put to or pulled from the store (not put again).
KNOWN_HASHES = 1 << 20
# Outcomes that say the store is unreachable or too slow.
_TRIPS = ("deadline", "disconnected", "source_dead")


class KvStoreLink:
    def __init__(self, address: str, block_manager: BlockManager, store: KvBlockStore,
                 timeout_s: float, window_bytes: int) -> None:
        self.address = address
        self.store = store
        self.receiver = KvReceiver(block_manager, store, timeout_s, window_bytes,
                                   max_inflight_bytes=8 * window_bytes, scales_sent=False)
        self.put_blocks = max(1, PUT_FRAME_BYTES // store.block_bytes)
        self.known: OrderedDict[bytes, None] = OrderedDict()
        self._pending: list[KvBlock] = []
        self._puts: list[KvPut] = []
        # For routers (CacheEvents.store_put, store_lost): hashes put since last told,
        # and whether the store was lost since.
        self._announced: list[bytes] = []
        self._lost = False
        # The store's own figures (blocks and bytes by tier), as its last answer to the
        # pings this link sends every PING_S.
        self.store_stats: Optional[StoreStats] = None
        self._next_ping = 0.0
        self.down_until = 0.0
        self.backoff = 0.0
        # Blocks put; blocks pulled (hits), asked for and not held (misses); transfers
        # that failed, by why; blocks not put or pulled while the link was down.
        self.num_put = 0
        self.num_hits = 0
        self.num_misses = 0
        self.errors: Counter = Counter()
        self.num_skipped = 0

    def up(self, now: float) -> bool:
        return now >= self.down_until

    # -- put ---------------------------------------------------------------------

    def put(self, blocks: Sequence[tuple[bytes, bytes]]) -> None:
        """Offer (hash, bytes) blocks to the store; those it is known to hold are not
        sent again."""
        if not self.up(time.monotonic()):
            self.num_skipped += len(blocks)
            return
        for block_hash, data in blocks:
            if block_hash in self.known:
                self.known.move_to_end(block_hash)
                continue
            self._remember(block_hash)
            self._announced.append(block_hash)
            self._pending.append(KvBlock(block_hash, checksum(data), data))
            if len(self._pending) >= self.put_blocks:
                self._flush()

    def news(self) -> tuple[list[bytes], bool]:
        """What routers should hear since they were last told: the hashes put, and
        whether the store was lost (forget what it was thought to hold)."""
        announced, lost = self._announced, self._lost
        self._announced, self._lost = [], False
        return announced, lost

    def unknown(self, hashes: Sequence[bytes]) -> list[int]:
        """The indexes of ``hashes`` the store is not known to hold."""
        return [i for i, h in enumerate(hashes) if h not in self.known]

    def messages(self) -> list[tuple[str, object]]:
        """(the store's address, KvPut or KvPull) to send now."""
        self._flush()
        out: list[tuple[str, object]] = [(PUT_CHANNEL + self.address, put)
                                         for put in self._puts]
        self._puts = []
        now = time.monotonic()
        if now >= self._next_ping and self.up(now):
            self._next_ping = now + PING_S
            out.append((self.address, Ping(nonce=0)))
        return out + self.receiver.pulls()

    def pong(self, pong: StorePong) -> None:
        self.store_stats = pong.stats

    # -- pull --------------------------------------------------------------------

    def start(self, request: Request, cached: list[int], skip: int, now: float) -> bool:
        """Ask the store for the request's prompt blocks after its ``cached`` prefix
        (BlockManager.find_cached_prefix) and the ``skip`` blocks after that (held by
        the tiers below the pool); False when nothing is asked (schedule the request
        now)."""
        if not self.up(now):
            return False
        source = KvSource(address=self.address, request_id=request.request_id)
        return self.receiver.start(request, source, now, skip, cached)

    def receive(self, reply: KvBlocks, now: float) -> list[KvTransfer]:
        return self._ended(self.receiver.receive(self.address, reply, now), now)

    def failed(self, reason: str, now: float) -> list[KvTransfer]:
        """The connection to the store dropped: its transfers end, and the link trips."""
        self._trip(now)
        return self._ended(self.receiver.fail_source(self.address, reason, now), now)

    def expire(self, now: float) -> list[KvTransfer]:
        return self._ended(self.receiver.expire(now), now)

    # -- internals ---------------------------------------------------------------

    def _ended(self, transfers: list[KvTransfer], now: float) -> list[KvTransfer]:
        for t in transfers:
            if t.outcome not in ("complete", "source"):
                logger.warning("KV store transfer for %s ended early (%s) after %d of %d "
                               "block(s); computing the rest", t.request.request_id,
                               t.outcome, t.num_done, len(t.hashes))
            self.num_hits += t.num_done
            for block_hash in t.hashes[:t.num_done]:
                self._remember(block_hash)
            if t.outcome in ("complete", "source"):   # answered ("source": a miss)
                self.num_misses += len(t.hashes) - t.num_done
                self.backoff = 0.0
                continue
            self.errors[t.outcome] += 1
            if t.outcome in _TRIPS:
                self._trip(now)
        return transfers

    def _trip(self, now: float) -> None:
        self.backoff = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * self.backoff))
        self.down_until = now + self.backoff
        self.known.clear()
        self._pending.clear()
        self._puts.clear()
        self._announced.clear()
        self._lost = True

    def _remember(self, block_hash: bytes) -> None:
        self.known[block_hash] = None
        if len(self.known) > KNOWN_HASHES:
            self.known.popitem(last=False)

    def _flush(self) -> None:
        if self._pending:
            self._puts.append(KvPut(layout=self.store.layout, blocks=self._pending))
            self.num_put += len(self._pending)
            self._pending = []

    def stats(self) -> dict:
        held = self.store_stats or StoreStats()
        return dict(kv_store_put_blocks=self.num_put, kv_store_hits=self.num_hits,
                    kv_store_misses=self.num_misses, kv_store_errors=dict(self.errors),
                    kv_store_up=self.up(time.monotonic()), kv_store_blocks=held.blocks,
                    kv_store_bytes=held.bytes)


def request_blocks(request: Request) -> tuple[list[int], list[bytes]]:
    """A request's blocks registered in the prefix cache: their ids and hashes."""
    table = request.blocks
    n = min(table.num_registered, len(table.block_hashes), len(table.block_ids))
    return table.block_ids[table.released:n], table.block_hashes[table.released:n]
