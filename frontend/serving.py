"""The path of one completion request through the system, after HTTP parsing:
admission, tokenization, routing, validation against the engine's limits, submission
of one engine request per choice, and the merged stream of their deltas.

Admission (frontend/admission.py) is decided before any tokenizing, for everything
the request will cost: a request for more choices (n x prompts) than one request may
have is refused at once (400), as is one that could never be admitted (413), and one
that finds the server full is told to retry (429). Everything the engine would refuse
is checked here too, so that a streaming request fails with a 400 before its stream
starts rather than inside it.

Deadlines: tokenization that takes longer than tokenize_timeout_s, and (when set) a
whole request that takes longer than request_timeout_s, end with 504; the engine
requests are aborted and the admission share given back, as on every other way a
request ends (``finish``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence, Union

from common.config import FrontendConfig
from common.errors import InvalidRequestError
from common.protocol import (ChatMessage, EngineStats, FinishReason, Ready, RequestOutput,
                             SamplingParams)
from common.structured import GrammarCompiler
from common.validation import ContextLengthError, checked_prompt
from engine_worker.client import EngineClient, EngineDeadError, EngineRequestError
from frontend.admission import Admission, Ticket, estimate_tokens
from frontend.choice import Choice, ChoiceFailed, Delta
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher
from frontend.errors import APIError
from frontend.grammar_cache import CheckedGrammars
from frontend.metrics import Metrics
from frontend.openai_protocol import ChatCompletionRequest
from frontend.router import EngineRouter
from frontend.tools import ToolPlan, plan_tools
from tokenizer_worker.client import TokenizeFailed, TokenizerClient, TokenizerDeadError

logger = logging.getLogger(__name__)


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
    # best_of > n: the number of choices per prompt to return (the most likely ones).
    keep: Optional[int] = None
    # echo: each prompt's text, shown before its completions.
    echo: Optional[list[str]] = None
    # Chat with tool calls possible: how they are made.
    tool_plan: Optional[ToolPlan] = None
    # prompt_logprobs asked for: shown with each choice.
    prompt_logprobs: bool = False
    engine: Optional[EngineClient] = None
    # The engine that served it (its address), kept for the timing breakdown.
    engine_address: str = ""
    # Monotonic time by which it must be done (request_timeout_s), or None.
    deadline: Optional[float] = None
    # Every choice's deltas (or the error that ends the job), as they arrive.
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False

    def timing(self) -> dict:
        first = self.choices[0]
        ttft = None if self.first_token_time is None else (
            (self.first_token_time - self.received) * 1e3)
        return {"tokenize_ms": round(self.tokenize_ms, 3), "queue_ms": first.queue_ms,
                "prefill_ms": first.prefill_ms, "ttft_ms": ttft, "engine": self.engine_address}

    def usage(self) -> dict:
        cached = sum(self.choices[i * self.n].num_cached_tokens or 0
                     for i in range(len(self.prompts)))
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass(frozen=True)
class EngineSnapshot:
    address: str
    healthy: bool
    # Requests assigned and not finished; routed since start, and for a prefix it held.
    load: int
    num_routed: int
    num_prefix_routed: int
    # As of the engine's last heartbeat (None before the first).
    stats: Optional[EngineStats]


@dataclass(frozen=True)
class PipelineSnapshot:
    """What the pipeline publishes of its state (frontend/metrics.py reads this and
    nothing else of the pipeline)."""

    engines: list[EngineSnapshot]
    num_jobs: int
    admitted_requests: int
    admitted_tokens: int
    # Tokenize jobs waiting or running in the pool, and sent but not yet answered.
    tokenizer_queue: int


class Pipeline:
    def __init__(self, engines: EngineRouter, tokenizer_client: TokenizerClient, tokenizer,
                 metrics: Metrics, admission: Admission, model_names: Sequence[str],
                 config: FrontendConfig, chat_template: Optional[str] = None,
                 grammars: Optional[GrammarCompiler] = None) -> None:
        """``tokenizer``: the model's Rust tokenizer, for decoding output and bad words;
        ``grammars``: for checking structured output before it reaches an engine (None:
        structured output is unavailable)."""
        self.engines = engines
        self.tokenizer_client = tokenizer_client
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # Constraints compiled off the event loop, each distinct one once.
        self.grammars = None if grammars is None else CheckedGrammars(grammars)
        self.metrics = metrics
        self.admission = admission
        # The names the model is served under; the first is its id in /v1/models.
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]
        self.config = config
        # Jobs started and not finished (HTTP requests being served).
        self.num_jobs = 0

    def snapshot(self) -> PipelineSnapshot:
        pool = self.tokenizer_client.last_pong
        return PipelineSnapshot(
            engines=[EngineSnapshot(
                address=e.address, healthy=e.client.healthy, load=e.load,
                num_routed=e.num_routed, num_prefix_routed=e.num_prefix_routed,
                stats=None if e.client.last_pong is None else e.client.last_pong.stats)
                for e in self.engines.engines],
            num_jobs=self.num_jobs, admitted_requests=self.admission.requests,
            admitted_tokens=self.admission.tokens,
            tokenizer_queue=(pool.num_pending if pool else 0) + self.tokenizer_client.num_pending)

    # -- building a job --------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(f"'{m}'" for m in self.model_names)
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"{served}", param="model", code="model_not_found")

    async def start(self, body, prompts: Sequence[Union[str, list[int]]],
                    messages: Optional[list[ChatMessage]], max_tokens: Optional[int],
                    num_logprobs: Optional[int], prefix: str, received: float,
                    add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None) -> Job:
        """Admit, tokenize, route and validate; the Job is ready to run. Raises APIError."""
        self.check_model(body.model)
        constraints, tool_plan = await self._constraints(body)
        n = body.num_generated()
        ticket = self._admit(body, n, prompts, messages)
        deadline = (None if self.config.request_timeout_s is None
                    else received + self.config.request_timeout_s)
        engine: Optional[EngineClient] = None
        try:
            token_prompts, tokenize_ms = await self._tokenize(
                prompts, messages, add_generation_prompt, deadline, tools)
            ticket.resize(n * sum(len(p) for p in token_prompts))
            engine = self.engines.pick(token_prompts[0])
            job = Job(request_id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()),
                      model=body.model, received=received, ticket=ticket,
                      prompts=token_prompts, choices=[], params=[], n=n,
                      tokenize_ms=tokenize_ms, num_logprobs=num_logprobs,
                      include_usage=bool(body.stream_options and body.stream_options.include_usage),
                      return_token_ids=body.return_token_ids, engine_address=engine.address,
                      deadline=deadline, keep=body.n if n > body.n else None,
                      tool_plan=tool_plan, prompt_logprobs=body.prompt_logprobs is not None)
            self._add_choices(job, body, engine, max_tokens, num_logprobs, constraints)
            if getattr(body, "echo", False):
                job.echo = [p if isinstance(p, str) and body.truncate_prompt_tokens is None
                            else self.tokenizer.decode(ids, skip_special_tokens=False)
                            for p, ids in zip(prompts, job.prompts)]
            job.engine = engine
            self.num_jobs += 1
            return job
        except BaseException:
            ticket.release()
            if engine is not None:
                self.engines.release(engine)
            raise

    def _admit(self, body, n: int, prompts: Sequence[Union[str, list[int]]],
               messages: Optional[list[ChatMessage]]) -> Ticket:
        """The request's admission share: n x prompts engine requests, and their prompt
        tokens as estimated before tokenizing. Raises APIError (400, 429)."""
        num_prompts = 1 if messages is not None else len(prompts)
        num_choices = num_prompts * n
        limit = self.config.max_choices_per_request
        if num_choices > limit:
            per = f"n={n}" if n == body.n else f"best_of={n}"
            raise APIError(400, f"this request asks for {num_choices} completions "
                                f"({num_prompts} prompt(s) x {per}); at most {limit} are "
                                f"allowed per request", param="n" if num_prompts == 1 else "prompt",
                           code="too_many_choices")
        if messages is not None:
            estimate = sum(len(m.content) for m in messages) // 4 + 1
        else:
            estimate = sum(estimate_tokens(p) for p in prompts)
        return self.admission.admit(num_choices, n * estimate)

    def _add_choices(self, job: Job, body, engine: EngineClient, max_tokens: Optional[int],
                     num_logprobs: Optional[int], constraints: dict) -> None:
        """n choices per prompt, each checked against the engine's limits (engines
        may differ)."""
        ready = engine.ready
        assert ready is not None
        # best_of ranks choices by their log probability: the engine must report it.
        engine_logprobs = num_logprobs if job.n == body.n else (num_logprobs or 0)
        for p, prompt_ids in enumerate(job.prompts):
            for j in range(job.n):
                index = p * job.n + j
                params = body.sampling_params(max_tokens, engine_logprobs, j, **constraints)
                prompt_ids = self._validate(prompt_ids, params, ready)
                job.params.append(params)
                job.choices.append(Choice(
                    index=index, request_id=f"{job.request_id}-{index}",
                    prompt_token_ids=prompt_ids,
                    detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                       body.skip_special_tokens),
                    stops=StopStringMatcher(body.stop_strings(), body.include_stop_str_in_output),
                    eos_token_ids=frozenset(ready.eos_token_ids)))
                job.prompts[p] = prompt_ids

    async def _constraints(self, body) -> tuple[dict, Optional[ToolPlan]]:
        """The sampling fields the frontend works out (structured output, bad words'
        token ids) and the request's tool plan. Raises APIError (400) for a schema,
        grammar or tool choice that cannot be served."""
        try:
            structured = body.structured_output()
            plan = None
            if isinstance(body, ChatCompletionRequest):
                plan = plan_tools(body, self.chat_template)
                if plan is not None and plan.structured is not None:
                    if structured is not None:
                        raise InvalidRequestError(
                            f"tool_choice forces a tool call and {structured.param} "
                            f"constrains the output too; give one of them", "tool_choice")
                    structured = plan.structured
            extra: dict = {}
            if structured is not None:
                if self.grammars is None:
                    raise InvalidRequestError("structured output is unavailable for this "
                                              "model's tokenizer", structured.param)
                await self.grammars.check(structured)
                extra["structured"] = structured
            if body.bad_words:
                extra["bad_words_ids"] = self._bad_words_ids(body.bad_words)
            if getattr(body, "echo", False) and body.logprobs is not None:
                # echo with logprobs shows the prompt's tokens' logprobs too.
                extra["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
        except InvalidRequestError as e:
            raise APIError(400, e.message, param=e.param, code="invalid_value") from None
        return extra, plan

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as it tokenizes alone and after a space (mid-sentence)."""
        out: list[list[int]] = []
        for word in words:
            if not word:
                raise InvalidRequestError("bad_words must not hold an empty string", "bad_words")
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out

    async def _tokenize(self, prompts, messages, add_generation_prompt,
                        deadline: Optional[float], tools: Optional[list[dict]] = None
                        ) -> tuple[list[list[int]], float]:
        if messages is None and all(isinstance(p, list) for p in prompts):
            return [list(p) for p in prompts], 0.0  # token ids: the pool is not involved
        return await self._within_tokenize_timeout(
            self._tokenize_texts(prompts, messages, add_generation_prompt, tools), deadline)

    async def _within_tokenize_timeout(self, work, deadline: Optional[float] = None):
        """``work``'s result; a 504 when the pool takes longer than the tokenize
        timeout (or than what is left until ``deadline``)."""
        timeout = self.config.tokenize_timeout_s
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        try:
            return await asyncio.wait_for(work, timeout)
        except asyncio.TimeoutError:
            raise APIError(504, f"tokenization did not finish within {timeout:.1f} s",
                           code="tokenize_timeout") from None

    async def _tokenize_texts(self, prompts, messages, add_generation_prompt, tools
                              ) -> tuple[list[list[int]], float]:
        if messages is not None:
            results = [await self._call_tokenizer(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools)]
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

    async def tokenize(self, **kw):
        """One text or chat through the pool (/tokenize), within the tokenize timeout."""
        return await self._within_tokenize_timeout(self._call_tokenizer(**kw))

    async def _call_tokenizer(self, **kw):
        try:
            return await self.tokenizer_client.tokenize(**kw)
        except TokenizeFailed as e:
            status = 400 if e.kind.value == "invalid_request" else 500
            raise APIError(status, e.message, param="messages" if "messages" in kw else "prompt")
        except TokenizerDeadError as e:
            raise APIError(503, f"the tokenizer pool is unavailable: {e}",
                           code="tokenizer_unavailable", headers={"Retry-After": "1"})

    def _validate(self, prompt_ids: list[int], params: SamplingParams, ready: Ready) -> list[int]:
        """What the engine would refuse, refused here (400; common/validation.py, which
        the engine runs too); returns the prompt as the engine will see it."""
        try:
            return checked_prompt(prompt_ids, params, ready.vocab_size, ready.max_model_len)
        except ContextLengthError as e:
            raise APIError(400, e.message, param=e.param, code="context_length_exceeded")
        except InvalidRequestError as e:
            raise APIError(400, e.message, param=e.param)

    # -- running a job ---------------------------------------------------------

    async def deltas(self, job: Job) -> AsyncIterator[Delta]:
        """Every choice's deltas, interleaved as they arrive, until all finish. The
        engine client hands each output to _on_output as it reads the step's frame:
        no task per choice."""
        engine = job.engine
        assert engine is not None
        for choice, params in zip(job.choices, job.params):
            engine.submit(choice.request_id, choice.prompt_token_ids, params,
                          functools.partial(self._on_output, job, choice))
        started = [False] * len(job.choices)
        remaining = len(job.choices)
        try:
            while remaining:
                item = await self._next(job.queue, job)
                if isinstance(item, BaseException):
                    raise self._as_api_error(item)
                if item.token_ids and not started[item.index]:
                    started[item.index] = True
                    job.ticket.release_one(len(job.choices[item.index].prompt_token_ids))
                    if job.first_token_time is None:
                        job.first_token_time = time.monotonic()
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self.finish(job)

    def _on_output(self, job: Job, choice: Choice,
                   item: Union[RequestOutput, BaseException]) -> None:
        """One engine output (or the error that ends the request) of one choice: into
        a delta on the job's queue. A stop string that ends the choice before the
        engine did aborts its engine request."""
        if job.done:
            return
        if not isinstance(item, BaseException):
            try:
                delta = choice.consume(item)
            except ChoiceFailed as e:
                item = e
            else:
                if delta.finish_reason is not None and item.finish_reason is None:
                    assert job.engine is not None
                    job.engine.cancel([choice.request_id])
                item = delta
        job.queue.put_nowait(item)

    async def _next(self, queue: asyncio.Queue, job: Job):
        if job.deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), job.deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise APIError(504, f"the request did not finish within "
                                f"{self.config.request_timeout_s:g} s (the server's request "
                                f"timeout)", code="request_timeout") from None

    def finish(self, job: Job) -> None:
        """Stop whatever still runs (a client that left, an error, a deadline), give
        back the admission share and the engine assignment, and record metrics.
        Idempotent: every path that ends a job calls it. Synchronous on purpose: it
        runs in finally blocks of cancelled tasks, where an await would be cancelled
        again (anyio cancellation is level-triggered) before the bookkeeping ran."""
        if job.done:
            return
        job.done = True
        self.num_jobs -= 1
        job.ticket.release()
        if job.engine is not None:
            # Engine requests still running (a client that left, an error, a deadline).
            job.engine.cancel([c.request_id for c in job.choices if c.finish_reason is None])
            self.engines.release(job.engine)
            job.engine = None
        job.finished = time.monotonic()
        self.metrics.record(job)

    @staticmethod
    def _as_api_error(error: BaseException) -> BaseException:
        if isinstance(error, APIError):
            return error
        if isinstance(error, EngineDeadError):
            return APIError(503, f"the engine serving this request failed: {error}",
                            code="engine_unavailable", headers={"Retry-After": "1"})
        if isinstance(error, EngineRequestError):
            status = {"invalid_request": 400, "overloaded": 503}.get(error.kind.value, 500)
            return APIError(status, error.message, param=error.param)
        if isinstance(error, ChoiceFailed):
            if error.reason is FinishReason.ERROR:
                return APIError(500, f"the request failed in the engine: {error}",
                                code="engine_error")
            return APIError(503, str(error), code="request_aborted",
                            headers={"Retry-After": "1"})
        return error

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
