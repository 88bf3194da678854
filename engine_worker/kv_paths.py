"""Where an engine's KV comes from and goes besides its own forward passes: prompt
blocks lent to decode engines (KvLeases), transfers from prefill engines (KvReceiver),
the tiers below the pool (kv_offload.py) and the shared KV store (kv_store_link.py).

The engine (engine.py) holds one KvPaths; the worker process (server.py) hands it the
peers' frames and sends what it has to send. A request that waits for its blocks is
given to the scheduler when its transfer ends, however it ends: what did not arrive is
computed.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import msgspec

from common.config import EngineConfig
from common.protocol import KvBlocks, KvPull, KvSource
from engine_worker.block_manager import BlockManager
from engine_worker.kv_offload import KvOffload
from engine_worker.kv_store_link import KvStoreLink
from engine_worker.kv_transfer import KvBlockStore, KvLeases, KvReceiver, KvTransfer
from engine_worker.model_runner import ModelRunner
from engine_worker.request import Request
from engine_worker.scheduler import Scheduler

logger = logging.getLogger(__name__)


class KvPaths:
    def __init__(self, config: EngineConfig, runner: ModelRunner, block_manager: BlockManager,
                 scheduler: Scheduler, layout: str) -> None:
        """layout: the KV layout's name (the model's, and its weights': KV of other
        weights, or of these in another format, is never taken for theirs)."""
        cache = config.cache
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.window_bytes = cache.kv_transfer_window_bytes
        # (an engine that lets blocks go computes the prompt itself: a transfer moves
        # whole tables)
        self.moves_tables = not runner.window
        store = KvBlockStore(runner.kv_caches, layout, runner.kv_scales)
        self.leases = KvLeases(block_manager, store)
        self.receiver = KvReceiver(block_manager, store, cache.kv_transfer_timeout_s,
                                   self.window_bytes, cache.kv_transfer_max_inflight_bytes)
        self.offload: Optional[KvOffload] = None
        self.store: Optional[KvStoreLink] = None
        if not (cache.kv_offload_memory_bytes or cache.kv_offload_dir
                or cache.kv_store_address):
            return
        if config.tensor_parallel_size > 1:
            raise ValueError("the KV offload tiers and the KV store hold whole blocks: not "
                             "with the model split over tensor-parallel ranks yet")
        if runner.window or not cache.enable_prefix_caching:
            raise ValueError("the KV offload tiers and the KV store keep prefix-cache "
                             "blocks of whole tables: they need the prefix cache, and an "
                             "engine that holds every layer's blocks (no sliding-window "
                             "pool)")
        if cache.kv_store_address:
            self.store = KvStoreLink(cache.kv_store_address, block_manager, store,
                                     cache.kv_store_timeout_s, self.window_bytes)
        self.offload = KvOffload(block_manager, store, cache.kv_offload_memory_bytes,
                                 cache.kv_offload_dir, cache.kv_offload_disk_bytes, self.store)
        scheduler.onload = self.offload.onload

    # -- requests ----------------------------------------------------------------

    def start(self, request: Request, source: Optional[KvSource], now: float) -> bool:
        """Pull a new request's prompt blocks: from ``source`` (a prefill engine), or
        the KV store's for those neither the pool nor the tiers below it hold. Whether
        the request now waits for them (False: schedule it now)."""
        if source is not None:
            return self.moves_tables and self.receiver.start(request, source, now)
        link = self.store
        if link is None or request.computes_prompt or not link.up(now):
            return False
        assert self.offload is not None
        cached = self.block_manager.find_cached_prefix(request.blocks, request.token_ids)
        return link.start(request, cached, self.offload.tier_run(request, len(cached)), now)

    def abort(self, request_id: str) -> bool:
        """A request is aborted: its lease ends; whether it was waiting for blocks
        (its transfer is cancelled; it holds nothing else)."""
        self.leases.release(request_id)
        return self.receiver.cancel(request_id) or (
            self.store is not None and self.store.receiver.cancel(request_id))

    def finished(self, request: Request, now: float) -> None:
        """A request ended: its prompt lent to a decode engine, its blocks kept below."""
        if request.kv_lease_s:
            self.leases.hold(request, request.kv_lease_s, now)
        if self.offload is not None:
            self.offload.finished(request)

    def poll(self) -> None:
        """Before each step: running requests' newly filled blocks to the KV store
        (CUDA: evicted blocks' bytes that reached the host)."""
        if self.offload is not None:
            self.offload.poll()
            self.offload.running(self.scheduler.running)

    # -- the peers: prefill engines, decode engines, the KV store ----------------

    def pulls(self) -> list[tuple[str, msgspec.Struct]]:
        """(address, KvPull or KvPut) to send now: to prefill engines, and to the KV
        store."""
        store = self.store.messages() if self.store is not None else []
        return self.receiver.pulls() + store

    def answer(self, pull: KvPull) -> KvBlocks:
        return self.leases.answer(pull, self.window_bytes)

    def receive(self, address: str, reply: KvBlocks) -> None:
        now = time.monotonic()
        if self._is_store(address):
            assert self.store is not None
            self._schedule(self.store.receive(reply, now))
        else:
            self._schedule(self._reported(self.receiver.receive(address, reply, now)))

    def source_failed(self, address: str, reason: str) -> None:
        """A prefill engine (or the KV store) is gone: its transfers end, the rest
        computed here."""
        now = time.monotonic()
        if self._is_store(address):
            assert self.store is not None
            logger.warning("the KV store at %s is unreachable (%s): computing without it "
                           "for a while", address, reason)
            self._schedule(self.store.failed(reason, now))
        else:
            self._schedule(self._reported(self.receiver.fail_source(address, reason, now)))

    def expire(self) -> Optional[float]:
        """End leases and transfers past their time; the next transfer deadline."""
        now = time.monotonic()
        self.leases.expire(now)
        self._schedule(self._reported(self.receiver.expire(now)))
        deadlines = [self.receiver.next_deadline()]
        if self.store is not None:
            self._schedule(self.store.expire(now))
            deadlines.append(self.store.receiver.next_deadline())
        return min((d for d in deadlines if d is not None), default=None)

    def _is_store(self, address: str) -> bool:
        return self.store is not None and address == self.store.address

    def _schedule(self, transfers: list[KvTransfer]) -> None:
        for t in transfers:
            self.scheduler.add(t.request)

    @staticmethod
    def _reported(transfers: list[KvTransfer]) -> list[KvTransfer]:
        """A prefill engine's transfers that ended: on their request's first output."""
        for t in transfers:
            request = t.request
            request.kv_outcome = t.outcome
            request.kv_blocks_received = t.num_done
            request.kv_transfer_ms = (t.finished - t.started) * 1e3
            if t.outcome != "complete":
                logger.warning("KV transfer for %s from %s ended early (%s) after %d of %d "
                               "block(s); computing the rest here", request.request_id,
                               t.source.address, t.outcome, t.num_done, len(t.hashes))
        return transfers

    # -- the rest ----------------------------------------------------------------

    def stats(self) -> dict:
        """EngineStats' KV fields."""
        kv = self.receiver.stats
        out = dict(kv_transfers=kv.num_transfers, kv_blocks_received=kv.num_blocks_received,
                   kv_bytes_received=kv.num_bytes_received,
                   kv_blocks_skipped=kv.num_blocks_skipped,
                   kv_transfer_seconds=kv.transfer_seconds, kv_fallbacks=dict(kv.fallbacks),
                   kv_blocks_sent=self.leases.num_blocks_sent,
                   kv_bytes_sent=self.leases.num_bytes_sent, kv_leases=len(self.leases.leases))
        tiers = self.offload
        if tiers is not None:
            held = tiers.snapshot()
            out.update(kv_offload_blocks=held["blocks"], kv_offload_bytes=held["bytes"],
                       kv_offload_stored=dict(tiers.stats.stored),
                       kv_offload_loaded=dict(tiers.stats.loaded),
                       kv_offload_missed=tiers.stats.missed, kv_offload_errors=tiers.errors())
        if self.store is not None:
            out.update(self.store.stats())
        return out

    def shutdown(self) -> None:
        """Before the process exits: the prefix cache left on the disk tier, if any,
        for the next engine on its directory."""
        if self.offload is not None and self.offload.disk is not None:
            count = self.offload.persist()
            logger.info("KV disk tier: %d cached block(s) written for the next engine", count)
