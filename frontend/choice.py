"""One choice of a completion: one engine request, its text and its bookkeeping.

A choice consumes the engine's outputs for its request and turns them into deltas of
text (detokenized, stop strings applied), token ids and logprobs. It ends when the
engine finishes the request or when a stop string matches (then the caller stops
reading, which aborts the engine request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

from common.protocol import FinishReason, RequestOutput, TokenLogprobs
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher


class ChoiceFailed(Exception):
    """The engine ended the request without finishing it: ``reason`` ABORT (it was
    shutting down) or ERROR (the request failed inside it)."""

    def __init__(self, message: str, reason: FinishReason) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, TokenLogprobs]]
    finish_reason: Optional[str] = None


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    # What stopped it (vLLM's stop_reason): the stop string, or the stop token id
    # other than EOS; None for EOS, a completed grammar or a length limit.
    stop_reason: Optional[Union[int, str]] = None
    num_cached_tokens: Optional[int] = None
    queue_ms: Optional[float] = None
    prefill_ms: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    # Seconds between consecutive token arrivals (for the ITL histogram).
    intervals: list[float] = field(default_factory=list)
    # prompt_logprobs: one entry per prompt token after the first.
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    # The model's EOS ids: a stop on one of them has no stop_reason.
    eos_token_ids: frozenset = frozenset()
    # Disaggregated: the engine that computed the prompt and the first token, and how
    # the decode engine's pull of the prompt's KV blocks from it went.
    prefill_engine: Optional[str] = None
    kv_outcome: Optional[str] = None
    kv_blocks_received: Optional[int] = None
    kv_transfer_ms: Optional[float] = None
    # False for echo's scoring (max_tokens 0): the engine is asked for one token, for
    # the prompt's logprobs, and the token is dropped; the choice ends on "length".
    generates: bool = True

    def consume(self, out: RequestOutput) -> Delta:
        now = time.monotonic()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.num_cached_tokens is not None and self.num_cached_tokens is None:
            # The first engine's figures (a decode engine continuing reports its own).
            self.num_cached_tokens = out.num_cached_tokens
            self.queue_ms, self.prefill_ms = out.queue_ms, out.prefill_ms
        if out.kv_outcome is not None:
            self.kv_outcome, self.kv_transfer_ms = out.kv_outcome, out.kv_transfer_ms
            self.kv_blocks_received = out.kv_blocks_received
        if out.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            raise ChoiceFailed(out.error or f"the engine ended the request "
                                            f"({out.finish_reason.value})", out.finish_reason)
        if not self.generates:
            if out.finish_reason is not None:
                self.finish_reason = "length"
            return Delta(self.index, "", [], [], self.finish_reason)
        new = out.new_token_ids
        if new:
            if self.first_token_time is None:
                self.first_token_time = now
            elif self.last_token_time is not None:
                self.intervals.append(now - self.last_token_time)
            self.last_token_time = now
        self.token_ids.extend(new)
        if out.logprobs:
            self.logprobs.extend(zip(new, out.logprobs))
        # The token that ended generation on "stop" (EOS or a stop token id) is not
        # part of the text; a completed grammar's last token is.
        visible = new[:-1] if out.stop_token_id is not None else new
        if out.stop_token_id is not None and out.stop_token_id not in self.eos_token_ids:
            self.stop_reason = out.stop_token_id
        text = self.stops.push(self.detokenizer.push(visible)) if visible else ""
        if self.stops.stopped is not None:
            self.finish_reason, self.stop_reason = "stop", self.stops.stopped
        elif out.finish_reason is not None:
            text += self.stops.push(self.detokenizer.flush())
            if self.stops.stopped is not None:
                self.finish_reason, self.stop_reason = "stop", self.stops.stopped
            else:
                text += self.stops.flush()
                self.finish_reason = out.finish_reason.value  # "stop" or "length"
        self.text.append(text)
        return Delta(self.index, text, list(new), list(zip(new, out.logprobs or [])),
                     self.finish_reason)
