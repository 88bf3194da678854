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

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, AbortRequests, AdapterCommand,
                             AdapterInfo, AdapterResult, AddRequest, CacheEvents, CacheSync,
                             Codec, OutputBatch, Pong, Ready, RequestError, RequestErrorKind,
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

    def __init__(self, address: str, store: Optional[StoreView] = None,
                 wanted_adapters: Optional[dict[str, str]] = None, **kw) -> None:
        """store: the frontend's view of the shared KV store, which this engine's
        reports of its puts feed. wanted_adapters: LoRA adapters (name -> folder) the
        frontend loaded, which an engine that says Ready without them is given."""
        super().__init__(address, Codec(CLIENT_MESSAGES, ENGINE_MESSAGES), **kw)
        self._sinks: dict[str, Sink] = {}
        self.cache = CacheView()
        self.store = store
        self._adapter_calls: dict[int, asyncio.Future] = {}
        # The LoRA adapters the engine serves, as it last said (Ready or an
        # AdapterResult)
        self.adapters: dict[str, AdapterInfo] = {}
        self.wanted_adapters = wanted_adapters if wanted_adapters is not None else {}
        self._restoring: set[str] = set()

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

    async def adapter(self, name: str, path: Optional[str] = None,
                      timeout_s: float = 120.0) -> AdapterResult:
        """Load the LoRA adapter at ``path`` as ``name`` (no path: unload it); the
        engine's answer. Raises the dead error if it is gone or does not answer."""
        self.check_alive()
        nonce = next(self._nonces)
        future = asyncio.get_running_loop().create_future()
        self._adapter_calls[nonce] = future
        try:
            self._send(AdapterCommand(nonce=nonce, name=name, path=path))
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise self.dead_error(f"no answer from the engine at {self.address} to "
                                  f"{'load' if path else 'unload'} {name!r} within "
                                  f"{timeout_s:.0f} s") from None
        finally:
            self._adapter_calls.pop(nonce, None)

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
        elif isinstance(message, AdapterResult):
            self._served(message.adapters)
            future = self._adapter_calls.get(message.nonce)
            if future is not None and not future.done():
                future.set_result(message)
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
        self._served(ready.adapters)
        super()._on_ready(ready)
        missing = {n: p for n, p in self.wanted_adapters.items()
                   if n not in self.adapters and n not in self._restoring}
        if missing:
            self._restoring.update(missing)
            asyncio.get_running_loop().create_task(self._restore(missing))

    async def _restore(self, adapters: dict[str, str]) -> None:
        """Give a (re)started engine the adapters loaded over HTTP since it started."""
        for name, path in adapters.items():
            if self.wanted_adapters.get(name) != path:   # (unloaded meanwhile)
                self._restoring.discard(name)
                continue
            try:
                result = await self.adapter(name, path)
                if name not in self.wanted_adapters and result.ok:   # (unloaded since)
                    await self.adapter(name)
            except Exception as e:   # gone again: its next Ready tries again
                logger.warning("could not load LoRA adapter %s on %s: %s", name,
                               self.address, e)
                self._restoring.difference_update(adapters)
                return
            finally:
                self._restoring.discard(name)
            if not result.ok:
                logger.warning("the engine at %s refused LoRA adapter %s: %s",
                               self.address, name, result.message)

    def _served(self, adapters) -> None:
        self.adapters = {a.name: a for a in adapters}

    def _fail_pending(self, error: Exception) -> None:
        for future in self._adapter_calls.values():
            if not future.done():
                future.set_exception(type(error)(str(error)))
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(type(error)(str(error)))  # one instance per waiter

    def _instance_id(self, ready: Ready) -> str:
        return ready.engine_id

    def _followed_ids(self) -> list[str]:
        return list(self._sinks)


__all__ = ["EngineClient", "EngineDeadError", "EngineRequestError", "RequestErrorKind"]
