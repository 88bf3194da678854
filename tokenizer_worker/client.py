"""The async client of the tokenizer pool (used by the frontend and the benchmark)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Optional

import msgspec

from common.protocol import (POOL_REPLIES, POOL_REQUESTS, ChatMessage, Codec, PoolPong,
                             PoolReady, RequestErrorKind, TokenizeError, TokenizeRequest,
                             TokenizeResult)
from common.service_client import ServiceClient, ServiceDeadError, ServiceRequestError


class TokenizerDeadError(ServiceDeadError):
    """The tokenizer pool is gone (or unreachable)."""


class TokenizeFailed(ServiceRequestError):
    """The pool could not tokenize one request."""


class TokenizerClient(ServiceClient):
    service = "tokenizer pool"
    ready_type = PoolReady
    pong_type = PoolPong
    dead_error = TokenizerDeadError

    def __init__(self, address: str, **kw) -> None:
        super().__init__(address, Codec(POOL_REQUESTS, POOL_REPLIES), **kw)
        self._waiting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()

    @property
    def num_pending(self) -> int:
        return len(self._waiting)

    async def tokenize(self, prompt: Optional[str] = None,
                       messages: Optional[list[ChatMessage]] = None, *,
                       suffix: Optional[str] = None,
                       add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       add_special_tokens: Optional[bool] = None,
                       tools: Optional[list[dict]] = None,
                       template_kwargs: Optional[dict] = None) -> TokenizeResult:
        """Token ids for a prompt or chat messages. Raises TokenizeFailed (the input's
        fault, or a crash) or TokenizerDeadError."""
        self.check_alive()
        request_id = str(next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            self._send(TokenizeRequest(
                request_id=request_id, prompt=prompt, suffix=suffix, messages=messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                add_special_tokens=add_special_tokens, tools=tools,
                template_kwargs=template_kwargs or {}))
            return await future
        finally:
            self._waiting.pop(request_id, None)

    def _dispatch(self, message: msgspec.Struct) -> None:
        future = self._waiting.pop(getattr(message, "request_id", ""), None)
        if future is None or future.done():
            return
        if isinstance(message, TokenizeResult):
            future.set_result(message)
        elif isinstance(message, TokenizeError):
            future.set_exception(TokenizeFailed(message))

    def _fail_pending(self, error: Exception) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(type(error)(str(error)))

    def _instance_id(self, ready: PoolReady) -> str:
        return ready.pool_id


__all__ = ["TokenizerClient", "TokenizerDeadError", "TokenizeFailed", "RequestErrorKind"]
