"""One HTTP request's completion, from admission to release.

A Job is opened when its request has been parsed (Pipeline.open) and closed once,
however the request ends: answered, failed, timed out, or left by its client. It
records what the request takes from the server as each thing is taken (the
admission share, the engine assignment, the engine requests), so that ``close``
gives back exactly what is held, whichever phase the request reached. One object
calls ``close``: the request's JobResponse (frontend/routes.py), in a finally block.

Between the two, the input processor fills in the engine requests and the output
processor the results; what a streamed response sends waits in ``outbox``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from common.ngram import Prediction
from common.protocol import SamplingParams
from frontend.admission import Ticket
from frontend.choice import Choice
from frontend.reasoning import ReasoningFormat
from frontend.tools import ToolPlan

if TYPE_CHECKING:
    from engine_worker.client import EngineClient
    from frontend.errors import APIError
    from frontend.formatters import Formatter


@dataclass
class Job:
    request_id: str
    created: int
    model: str
    # Monotonic time the request arrived.
    received: float
    stream: bool
    # The pipeline's part of closing: the engine assignment and the metrics.
    on_close: Callable[["Job"], None]
    # Monotonic time by which it must be done (request_timeout_s), or None.
    deadline: Optional[float] = None
    # The LoRA adapter the model field names (None: the base model)
    adapter: Optional[str] = None

    # -- held, given back by close() ---------------------------------------------
    ticket: Optional[Ticket] = None
    engine: Optional["EngineClient"] = None
    # The engine requests were sent (the choices' request ids are the engine's).
    submitted: bool = False
    timer: Optional[asyncio.TimerHandle] = None
    # Engines the requests were sent to before ``engine`` (retries).
    attempt: int = 0
    # Prefill/decode disaggregation: the engine computing the prompts and first
    # tokens (``engine`` decodes the rest), and the choices it has not finished.
    prefill: Optional["EngineClient"] = None
    # Counted toward the prefill engine's load (until no choice is prefilling).
    prefill_held: bool = False
    num_prefilling: int = 0

    # -- the request, as the input processor made it --------------------------------
    prompts: list[list[int]] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    # Choices per prompt (best_of, when it is larger than n).
    n: int = 1
    # best_of > n: the number of choices per prompt to return (the most likely ones).
    keep: Optional[int] = None
    tokenize_ms: float = 0.0
    include_usage: bool = False
    continuous_usage: bool = False  # the usage so far on every chunk
    return_token_ids: bool = False
    # Logprobs name tokens "token_id:N" (return_tokens_as_token_ids).
    tokens_as_ids: bool = False
    num_logprobs: Optional[int] = None
    # echo: each prompt's text, shown before its completions.
    echo: Optional[list[str]] = None
    # Chat with tool calls possible: how they are made.
    tool_plan: Optional[ToolPlan] = None
    # Chat with --reasoning-parser: how its replies' thinking is told apart, and
    # whether it is shown (the request's include_reasoning).
    reasoning: Optional[ReasoningFormat] = None
    include_reasoning: bool = True
    # ... and whether each choice starts in its thinking (read from its prompt once).
    thinks_first: list[bool] = field(default_factory=list)
    # prompt_logprobs asked for: shown with each choice.
    prompt_logprobs: bool = False
    # The caller's W3C trace context (frontend/tracing.py), for the request's span.
    trace: dict = field(default_factory=dict)
    # A predicted output: each choice's use of it, counted as its tokens come.
    predictions: list[Prediction] = field(default_factory=list)
    # The engine that served it (its address), kept for the timing breakdown.
    engine_address: str = ""
    formatter: Optional["Formatter"] = None

    # -- the results, as the output processor makes them ---------------------------
    # Choices not finished yet.
    remaining: int = 0
    # Some output of the engine was read (so the job can no longer move elsewhere).
    started: bool = False
    first_token_time: Optional[float] = None
    # Encoded SSE events not yet sent, and the signal that there are new ones (or
    # that the job has ended).
    outbox: list[bytes] = field(default_factory=list)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    # Tokens in the outbox since the last wake-up (--stream-interval).
    held: int = 0
    ended: bool = False
    # What ended it, if not every choice finishing.
    error: Optional["APIError"] = None
    closed: bool = False
    finished: float = 0.0

    def take(self) -> bytes:
        """The events waiting to be sent, as one write."""
        data = b"".join(self.outbox)
        self.outbox.clear()
        return data

    def close(self) -> None:
        """Give back everything the job holds: its admission share, the engine
        requests still running (a client that left, an error, a deadline) and its
        engine assignment; then the metrics. Idempotent. Synchronous on purpose: it
        runs in finally blocks of cancelled tasks, where an await would be cancelled
        again (anyio cancellation is level-triggered) before the bookkeeping ran."""
        if self.closed:
            return
        self.closed = self.ended = True
        self.finished = time.monotonic()
        if self.timer is not None:
            self.timer.cancel()
        if self.ticket is not None:
            self.ticket.release()
        if self.submitted:
            unfinished = [c.request_id for c in self.choices if c.finish_reason is None]
            for engine in (self.engine, self.prefill):
                # On a prefill engine this also lets go of blocks held for a transfer.
                if engine is not None:
                    engine.cancel(unfinished)
        self.on_close(self)

    def timing(self) -> dict:
        first = self.choices[0]
        ttft = None if self.first_token_time is None else (
            (self.first_token_time - self.received) * 1e3)
        timing = {"tokenize_ms": _ms(self.tokenize_ms), "queue_ms": _ms(first.queue_ms),
                  "prefill_ms": _ms(first.prefill_ms), "ttft_ms": _ms(ttft),
                  "engine": self.engine_address}
        if first.prefill_engine is not None:
            timing.update(prefill_engine=first.prefill_engine, kv_outcome=first.kv_outcome,
                          kv_blocks_received=first.kv_blocks_received,
                          kv_transfer_ms=_ms(first.kv_transfer_ms))
        return timing

    def usage(self) -> dict:
        cached = sum(self.choices[i * self.n].num_cached_tokens or 0
                     for i in range(len(self.prompts)))
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.reasoning is not None:
            thought = sum(self.reasoning.num_tokens(thinking, c.token_ids)
                          for thinking, c in zip(self.thinks_first, self.choices))
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}
        if self.predictions:
            counts = [p.count(c.token_ids) for p, c in zip(self.predictions, self.choices)]
            usage.setdefault("completion_tokens_details", {}).update(
                accepted_prediction_tokens=sum(a for a, _ in counts),
                rejected_prediction_tokens=sum(r for _, r in counts))
        return usage


def _ms(value: Optional[float]) -> Optional[float]:
    """A duration in milliseconds, to the microsecond."""
    return None if value is None else round(value, 3)
