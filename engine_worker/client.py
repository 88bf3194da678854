"""The async client of one engine worker, used by the frontend, benchmarks and tests.

Imports no torch: it speaks only the wire protocol (common/protocol.py). The receive
task dispatches each OutputBatch to the per-request queues in one pass; liveness
(DEAD frames, dropped connections, heartbeats) is common/service_client.py's.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence

import msgspec

from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, AbortRequests, AddRequest,
                             Codec, OutputBatch, Pong, Ready, RequestError, RequestErrorKind,
                             RequestOutput, SamplingParams)
from common.service_client import ServiceClient, ServiceDeadError, ServiceRequestError


class EngineDeadError(ServiceDeadError):
    """The engine is gone (or unreachable); the request did not complete."""


class EngineRequestError(ServiceRequestError):
    """The engine refused or failed one request."""


class EngineClient(ServiceClient):
    service = "engine"
    ready_type = Ready
    pong_type = Pong
    dead_error = EngineDeadError

    def __init__(self, address: str, **kw) -> None:
        super().__init__(address, Codec(CLIENT_MESSAGES, ENGINE_MESSAGES), **kw)
        self._streams: dict[str, asyncio.Queue] = {}

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: Optional[SamplingParams] = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes. Leaving the loop
        early (or being cancelled) aborts the request in the engine."""
        self.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            await self._send(AddRequest(request_id=request_id,
                                        prompt_token_ids=list(prompt_token_ids),
                                        params=params or SamplingParams()))
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
            if not finished and self._streams.pop(request_id, None) is not None:
                await self.abort([request_id])

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        if self.dead_reason is None and request_ids:
            await self._send(AbortRequests(request_ids=list(request_ids)))

    def _dispatch(self, message: msgspec.Struct) -> None:
        if isinstance(message, OutputBatch):
            streams = self._streams
            for out in message.outputs:
                stream = streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
                    if out.finish_reason is not None:
                        del streams[out.request_id]
        elif isinstance(message, RequestError):
            stream = self._streams.pop(message.request_id, None)
            if stream is not None:
                stream.put_nowait(EngineRequestError(message))

    def _fail_pending(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put_nowait(type(error)(str(error)))  # one instance per waiter

    def _instance_id(self, ready: Ready) -> str:
        return ready.engine_id

    def _followed_ids(self) -> list[str]:
        return list(self._streams)


__all__ = ["EngineClient", "EngineDeadError", "EngineRequestError", "RequestErrorKind"]
