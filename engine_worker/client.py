"""The async client of one engine worker, used by the frontend, benchmarks and tests.

Imports no torch: it speaks only the wire protocol (common/protocol.py). Each request
has a sink, a function that gets its outputs (and, instead of more outputs, the error
that ends it): each OutputBatch is handed to the sinks in one pass as it is read, with
no task or queue per request (``submit``). ``generate`` wraps that as an async
iterator. Liveness (DEAD frames, dropped connections, heartbeats) is
common/service_client.py's.

``cache`` mirrors what the engine's prefix cache holds, kept from the CacheEvents the
engine sends (a gap in their numbers asks for a snapshot): the router reads it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import AsyncIterator, Callable, Optional, Sequence, Union

import msgspec

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, AbortRequests, AddRequest,
                             CacheEvents, CacheSync, Codec, OutputBatch, Pong, Ready, RequestError, RequestErrorKind,
                             RequestOutput, SamplingParams)
from common.service_client import ServiceClient, ServiceDeadError, ServiceRequestError

logger = logging.getLogger(__name__)


class EngineDeadError(ServiceDeadError):
    """The engine is gone (or unreachable); the request did not complete."""


class EngineRequestError(ServiceRequestError):
    """The engine refused or failed one request."""


# Gets a request's outputs in order; an exception instead ends the request.
Sink = Callable[[Union[RequestOutput, BaseException]], None]

# A client that missed some cache events asks for a snapshot at most this often (the
# answer to an earlier request may itself have been lost).
RESYNC_INTERVAL_S = 1.0


class CacheView:
    """The chained block hashes an engine instance's prefix cache holds (``held``, as
    of its change number ``seq``), and those this client expects it to hold soon
    (``expected``: prompts sent there whose blocks no change has reported yet; a
    change that reports a hash stored or removed settles it). Memory: at most the
    engine's KV blocks each."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.expected: "OrderedDict[bytes, None]" = OrderedDict()
        # None until a snapshot arrives (changes before it are ignored).
        self.seq: Optional[int] = None
        self.num_resyncs = 0
        self._resync_asked = -RESYNC_INTERVAL_S

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.held or block_hash in self.expected

    def expect(self, hashes: Sequence[bytes], capacity: int) -> None:
        """A prompt with these block hashes was sent to the engine, which will cache
        them when it computes it (unless they are evicted first); the oldest
        expectations beyond ``capacity`` are dropped."""
        for h in hashes:
            if h not in self.held:
                self.expected[h] = None
                self.expected.move_to_end(h)
        while len(self.expected) > capacity:
            self.expected.popitem(last=False)

    def reset(self) -> None:
        """A new engine instance: nothing is known until its snapshot."""
        self.held.clear()
        self.expected.clear()
        self.seq = None

    def apply(self, events: CacheEvents, now: float) -> bool:
        """Take in one message; True when a snapshot should be asked for (a gap)."""
        if events.snapshot:
            self.held = set(events.stored)
            self._settle(self.held)
            self.seq = events.seq
            return False
        if self.seq is None or events.seq <= self.seq:
            return False  # before the snapshot, or already in it
        if events.seq != self.seq + 1:
            # Missed some: keep what is known (mostly right) until the snapshot.
            if now - self._resync_asked < RESYNC_INTERVAL_S:
                return False
            self._resync_asked = now
            self.num_resyncs += 1
            return True
        self.held.difference_update(events.removed)
        self.held.update(events.stored)
        self._settle(events.stored)
        self._settle(events.removed)
        self.seq = events.seq
        return False

    def _settle(self, hashes) -> None:
        if self.expected:
            for h in hashes:
                self.expected.pop(h, None)


class StoreView:
    """The blocks the shared KV store (kv_store/) is thought to hold, as the engines
    that use it report their puts (CacheEvents.store_put); forgotten when one reports
    the store lost. A router's hint, never a promise: the store's own evictions are
    not reported, and a block it no longer holds is computed by the engine that asks.
    At most ``capacity`` hashes, the oldest reported first out."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self.capacity = capacity
        self.held: dict[bytes, None] = {}   # in the order reported

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.held

    def apply(self, events: CacheEvents) -> None:
        if events.store_lost:
            self.held.clear()
        for h in events.store_put:
            self.held.pop(h, None)
            self.held[h] = None
        while len(self.held) > self.capacity:
            del self.held[next(iter(self.held))]


class EngineClient(ServiceClient):
    service = "engine"
    ready_type = Ready
    pong_type = Pong
    dead_error = EngineDeadError

    def __init__(self, address: str, store: Optional[StoreView] = None, **kw) -> None:
        """store: the frontend's view of the shared KV store, which this engine's
        reports of its puts feed."""
        super().__init__(address, Codec(CLIENT_MESSAGES, ENGINE_MESSAGES), **kw)
        self._sinks: dict[str, Sink] = {}
        self.cache = CacheView()
        self.store = store

    def submit(self, request_id: str, prompt_token_ids: Sequence[int],
               params: Optional[SamplingParams], sink: Sink, **disaggregation) -> None:
        """Submit a request: ``sink`` gets each of its outputs as the client reads
        them, the last one with a finish_reason, or an exception (the engine
        refused the request, or died) that ends it. Raises the dead error now if the
        engine is known to be gone. ``disaggregation``: AddRequest's output_token_ids,
        kv_lease_s, kv_source and output_interval."""
        self.check_alive()
        if request_id in self._sinks:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self._sinks[request_id] = sink
        self._send(AddRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                              params=params or SamplingParams(), **disaggregation))

    def cancel(self, request_ids: Sequence[str]) -> None:
        """Abort requests in the engine; their sinks get nothing more."""
        for request_id in request_ids:
            self._sinks.pop(request_id, None)
        if self.dead_reason is None and request_ids and self.sock is not None:
            self._send(AbortRequests(request_ids=list(request_ids)))

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: Optional[SamplingParams] = None,
                       **disaggregation) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes. Leaving the loop
        early (or being cancelled) aborts the request in the engine."""
        stream: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, params, stream.put_nowait, **disaggregation)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.cancel([request_id])

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.cancel(request_ids)

    def _dispatch(self, message: msgspec.Struct) -> None:
        if isinstance(message, OutputBatch):
            sinks = self._sinks
            for out in message.outputs:
                sink = sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finish_reason is not None:
                    del sinks[out.request_id]
                try:
                    sink(out)
                except Exception:  # the receiver's bug: its request alone is dropped
                    logger.exception("the receiver of %s failed; aborting it", out.request_id)
                    self.cancel([out.request_id])
        elif isinstance(message, RequestError):
            sink = self._sinks.pop(message.request_id, None)
            if sink is not None:
                sink(EngineRequestError(message))
        elif isinstance(message, CacheEvents):
            if self.store is not None and (message.store_put or message.store_lost):
                self.store.apply(message)
            if self.cache.apply(message, time.monotonic()):
                logger.info("missed prefix-cache changes of the engine at %s (%d after "
                            "%s): asking for a snapshot", self.address, message.seq,
                            self.cache.seq)
                self._send(CacheSync())

    def _on_ready(self, ready: Ready) -> None:
        if self.ready is None or ready.engine_id != self.ready.engine_id:
            self.cache.reset()
        super()._on_ready(ready)

    def _fail_pending(self, error: Exception) -> None:
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(type(error)(str(error)))  # one instance per waiter

    def _instance_id(self, ready: Ready) -> str:
        return ready.engine_id

    def _followed_ids(self) -> list[str]:
        return list(self._sinks)


__all__ = ["EngineClient", "EngineDeadError", "EngineRequestError", "RequestErrorKind"]
