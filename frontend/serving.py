"""The path of one completion request through the system, after HTTP parsing:
admission, tokenization, validation against the engine's limits, submission of one
engine request per choice, and the merged stream of their deltas.

Admission is decided before any tokenizing: a request that would push the frontend
past its limit of waiting requests or waiting prompt tokens (admitted here and not yet
producing tokens) is refused with 429 at once. Everything the engine would refuse is
checked here too, so that a streaming request fails with a 400 before its stream
starts rather than inside it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence, Union

from common.errors import InvalidRequestError
from common.protocol import ChatMessage, Ready, SamplingParams
from engine_worker.client import EngineClient, EngineDeadError, EngineRequestError
from frontend.choice import Choice, ChoiceFailed, Delta
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher
from frontend.errors import APIError
from frontend.metrics import Metrics
from tokenizer_worker.client import TokenizeFailed, TokenizerClient, TokenizerDeadError

logger = logging.getLogger(__name__)

# Characters per token assumed when estimating a text prompt's size for admission.
_EST_CHARS_PER_TOKEN = 4


class Admission:
    """Counts requests admitted and not yet producing tokens, and their prompt tokens."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests = 0
        self.tokens = 0

    def admit(self, estimated_tokens: int) -> "Ticket":
        if self.requests >= self.max_requests or (
                self.requests and self.tokens + estimated_tokens > self.max_tokens):
            raise APIError(429, f"the server is at its limit of {self.max_requests} waiting "
                                f"requests or {self.max_tokens} waiting prompt tokens; retry "
                                f"shortly", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.requests += 1
        self.tokens += estimated_tokens
        return Ticket(self, estimated_tokens)


@dataclass
class Ticket:
    admission: Admission
    tokens: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.requests -= 1
            self.admission.tokens -= self.tokens


class EngineRouter:
    """Picks an engine for a request: a healthy one with the fewest jobs assigned
    (counted from the pick, so a burst still being tokenized spreads out)."""

    def __init__(self, clients: Sequence[EngineClient]) -> None:
        self.clients = list(clients)
        self.assigned = {id(c): 0 for c in self.clients}

    def pick(self) -> EngineClient:
        healthy = [c for c in self.clients if c.healthy]
        if not healthy:
            reasons = "; ".join(c.dead_reason or "" for c in self.clients)
            raise APIError(503, f"no engine is available ({reasons})",
                           code="engine_unavailable")
        client = min(healthy, key=lambda c: self.assigned[id(c)])
        self.assigned[id(client)] += 1
        return client

    def release(self, client: EngineClient) -> None:
        self.assigned[id(client)] -= 1

    def ready(self) -> Ready:
        for client in self.clients:
            if client.ready is not None:
                return client.ready
        raise APIError(503, "no engine has started", code="engine_unavailable")


@dataclass
class Job:
    """One HTTP request's completion: its prompts and choices."""

    request_id: str
    created: int
    model: str
    received: float
    ticket: Ticket
    prompts: list[list[int]]
    choices: list[Choice]
    params: list[SamplingParams]
    n: int
    tokenize_ms: float = 0.0
    first_token_time: Optional[float] = None
    finished: float = 0.0
    include_usage: bool = False
    return_token_ids: bool = False
    num_logprobs: Optional[int] = None
    engine: Optional[EngineClient] = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    done: bool = False

    def timing(self) -> dict:
        first = self.choices[0]
        ttft = None if self.first_token_time is None else (
            (self.first_token_time - self.received) * 1e3)
        return {"tokenize_ms": round(self.tokenize_ms, 3), "queue_ms": first.queue_ms,
                "prefill_ms": first.prefill_ms, "ttft_ms": ttft}

    def usage(self) -> dict:
        cached = sum(self.choices[i * self.n].num_cached_tokens or 0
                     for i in range(len(self.prompts)))
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class Pipeline:
    def __init__(self, engines: EngineRouter, tokenizer_client: TokenizerClient, tokenizer,
                 metrics: Metrics, admission: Admission, model_name: str) -> None:
        """``tokenizer``: the model's Rust tokenizer, for decoding output."""
        self.engines = engines
        self.tokenizer_client = tokenizer_client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.admission = admission
        self.model_name = model_name

    # -- building a job --------------------------------------------------------

    async def start(self, body, prompts: Sequence[Union[str, list[int]]],
                    messages: Optional[list[ChatMessage]], max_tokens: Optional[int],
                    num_logprobs: Optional[int], prefix: str, received: float,
                    add_generation_prompt: bool = True) -> Job:
        """Admit, tokenize and validate; the Job is ready to run. Raises APIError."""
        if body.model != self.model_name:
            raise APIError(400, f"the model '{body.model}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")
        estimate = sum(len(p) if isinstance(p, list) else len(p) // _EST_CHARS_PER_TOKEN + 1
                       for p in prompts) if messages is None else (
            sum(len(m.content) for m in messages) // _EST_CHARS_PER_TOKEN + 1)
        ticket = self.admission.admit(estimate)
        engine: Optional[EngineClient] = None
        try:
            engine = self.engines.pick()
            ready = engine.ready  # its limits: engines may differ
            assert ready is not None
            token_prompts, tokenize_ms = await self._tokenize(prompts, messages,
                                                              add_generation_prompt)
            job = Job(request_id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()),
                      model=self.model_name, received=received, ticket=ticket,
                      prompts=token_prompts, choices=[], params=[], n=body.n,
                      tokenize_ms=tokenize_ms, num_logprobs=num_logprobs,
                      include_usage=bool(body.stream_options and body.stream_options.include_usage),
                      return_token_ids=body.return_token_ids)
            for p, prompt_ids in enumerate(token_prompts):
                for j in range(body.n):
                    index = p * body.n + j
                    params = body.sampling_params(max_tokens, num_logprobs, j)
                    prompt_ids = self._validate(prompt_ids, params, ready)
                    job.params.append(params)
                    job.choices.append(Choice(
                        index=index, request_id=f"{job.request_id}-{index}",
                        prompt_token_ids=prompt_ids,
                        detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                           body.skip_special_tokens),
                        stops=StopStringMatcher(body.stop_strings())))
                    job.prompts[p] = prompt_ids
            job.engine = engine
            return job
        except BaseException:
            ticket.release()
            if engine is not None:
                self.engines.release(engine)
            raise

    async def _tokenize(self, prompts, messages, add_generation_prompt
                        ) -> tuple[list[list[int]], float]:
        if messages is not None:
            results = [await self._call_tokenizer(
                messages=messages, add_generation_prompt=add_generation_prompt)]
        else:
            texts = [p for p in prompts if isinstance(p, str)]
            results = await asyncio.gather(*[self._call_tokenizer(prompt=t) for t in texts])
        by_text = iter(results)
        token_prompts = []
        for p in prompts if messages is None else [None]:
            token_prompts.append(list(p) if isinstance(p, list) else
                                 list(next(by_text).prompt_token_ids))
        tokenize_ms = max((r.tokenize_ms for r in results), default=0.0)
        return token_prompts, tokenize_ms

    async def _call_tokenizer(self, **kw):
        try:
            return await self.tokenizer_client.tokenize(**kw)
        except TokenizeFailed as e:
            status = 400 if e.kind.value == "invalid_request" else 500
            raise APIError(status, e.message, param="messages" if "messages" in kw else "prompt")
        except TokenizerDeadError as e:
            raise APIError(503, f"the tokenizer pool is unavailable: {e}",
                           code="tokenizer_unavailable")

    def _validate(self, prompt_ids: list[int], params: SamplingParams, ready: Ready) -> list[int]:
        """What the engine would refuse, refused here (400); returns the prompt as the
        engine will see it (truncated if asked)."""
        try:
            params.validate()
        except InvalidRequestError as e:
            raise APIError(400, e.message, param=e.param)
        if params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens:]
        if not prompt_ids:
            raise APIError(400, "the prompt is empty; it needs at least one token", param="prompt")
        vocab = ready.vocab_size
        for name, ids in (("prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{name} has token id {bad} outside the vocabulary "
                                    f"[0, {vocab})", param=name)
        limit, n = ready.max_model_len, len(prompt_ids)
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but "
                                f"the prompt has {n} tokens and max_tokens is "
                                f"{params.max_tokens} ({n + params.max_tokens} in total)",
                           param="max_tokens", code="context_length_exceeded")
        if n >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but "
                                f"the prompt has {n} tokens, leaving no room to generate",
                           param="prompt", code="context_length_exceeded")
        return prompt_ids

    # -- running a job ---------------------------------------------------------

    async def deltas(self, job: Job) -> AsyncIterator[Delta]:
        """Every choice's deltas, interleaved as they arrive, until all finish."""
        engine = job.engine
        assert engine is not None
        queue: asyncio.Queue = asyncio.Queue()

        async def run(choice: Choice, params: SamplingParams) -> None:
            try:
                async for out in engine.generate(choice.request_id, choice.prompt_token_ids,
                                                 params):
                    delta = choice.consume(out)
                    queue.put_nowait(delta)
                    if delta.finish_reason is not None:
                        return  # leaving the loop aborts an engine request still running
            except BaseException as e:  # handed to the consumer, which re-raises
                queue.put_nowait(e)
                if isinstance(e, asyncio.CancelledError):
                    raise

        job.tasks = [asyncio.create_task(run(c, p)) for c, p in zip(job.choices, job.params)]
        remaining = len(job.choices)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise self._as_api_error(item)
                if item.token_ids and job.first_token_time is None:
                    job.first_token_time = time.monotonic()
                    job.ticket.release()
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self.finish(job)

    def finish(self, job: Job) -> None:
        """Stop whatever still runs (a client that left, an error), give back the
        admission ticket and the engine assignment, and record metrics. Idempotent:
        every path that ends a job calls it. Synchronous on purpose: it runs in
        finally blocks of cancelled tasks, where an await would be cancelled again
        (anyio cancellation is level-triggered) before the bookkeeping ran."""
        if job.done:
            return
        job.done = True
        for task in job.tasks:
            task.cancel()  # each choice's stream then aborts its engine request
        job.ticket.release()
        if job.engine is not None:
            self.engines.release(job.engine)
            job.engine = None
        job.finished = time.monotonic()
        m = self.metrics
        m.e2e.observe(job.finished - job.received)
        if job.first_token_time is not None:
            m.ttft.observe(job.first_token_time - job.received)
        m.prompt_tokens.inc(sum(len(p) for p in job.prompts))
        for choice in job.choices:
            m.generation_tokens.inc(len(choice.token_ids))
            m.requests.labels(choice.finish_reason or "abort").inc()
            if choice.queue_ms is not None:
                m.queue.observe(choice.queue_ms / 1e3)
            for interval in choice.intervals:
                m.itl.observe(interval)

    @staticmethod
    def _as_api_error(error: BaseException) -> BaseException:
        if isinstance(error, APIError):
            return error
        if isinstance(error, EngineDeadError):
            return APIError(503, f"the engine is unavailable: {error}", code="engine_unavailable")
        if isinstance(error, EngineRequestError):
            status = {"invalid_request": 400, "overloaded": 503}.get(error.kind.value, 500)
            return APIError(status, error.message, param=error.param)
        if isinstance(error, ChoiceFailed):
            return APIError(503, str(error), code="request_aborted")
        return error

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

