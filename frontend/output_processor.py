"""From engine outputs to what each response sends.

The engine clients' receive tasks read one frame per engine step (an OutputBatch) and
hand each of its outputs here, in one pass, with no task or queue per choice. For
each output this detokenizes, applies stop strings (aborting the engine request a
stop string ended early), records logprobs and timings, gives back the admission
share on a choice's first token and, for a streamed response, formats and encodes
the SSE event (tool-call parsing included) into the job's outbox. The job's wake-up
is an asyncio.Event: setting it for each of a job's outputs in one frame wakes its
response once, which then sends everything waiting as one write.

A job ends when every choice has finished, or at the first error (an engine refusal,
an engine's death, a choice the engine failed, the request deadline): a stream then
gets the error as its last event, a full response the error's status.

Retries: a job none of whose outputs has been read yet is sent whole to another
engine (up to ``retries`` times) when its engine refused it for draining, died, or
aborted it on its own (a drain past its timeout); the client sees nothing of it.
Once any output has been read the job stays where it is: what was sent cannot be
taken back, and sampling elsewhere would not continue it. An error of the request's
own (invalid, or failed in a step) is never retried.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Union

import msgspec

from common.protocol import FinishReason, Ready, RequestErrorKind, RequestOutput
from engine_worker.client import EngineDeadError, EngineRequestError
from frontend.choice import Choice, ChoiceFailed
from frontend.errors import APIError
from frontend.job import Job
from frontend.router import EngineRouter

logger = logging.getLogger(__name__)

_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"


def sse(body: dict) -> bytes:
    return b"data: " + _encode(body) + b"\n\n"


class OutputProcessor:
    def __init__(self, router: EngineRouter, retries: int) -> None:
        self.router = router
        self.retries = retries
        # Jobs sent to another engine since start (each time counts).
        self.num_retries = 0

    def submit(self, job: Job) -> None:
        """Send the job's engine requests, each with this processor as its receiver,
        and arm its deadline."""
        assert job.formatter is not None
        job.remaining = len(job.choices)
        if job.stream:
            job.outbox.extend(sse(chunk) for chunk in job.formatter.first_chunks())
        self._send(job)
        if job.deadline is not None:
            job.timer = asyncio.get_running_loop().call_at(
                job.deadline, self._expire, job)
        job.wakeup.set()

    def _send(self, job: Job) -> None:
        engine = job.engine
        assert engine is not None
        job.submitted = True
        try:
            for choice, params in zip(job.choices, job.params):
                engine.submit(choice.request_id, choice.prompt_token_ids, params,
                              functools.partial(self._on_output, job, choice, job.attempt))
        except EngineDeadError as e:  # it died since it was picked (before any choice went)
            self._retry_or_fail(job, e)

    def _on_output(self, job: Job, choice: Choice, attempt: int,
                   item: Union[RequestOutput, BaseException]) -> None:
        """One engine output (or the error that ends the request) of one choice, sent
        to the job's ``attempt``-th engine."""
        if job.ended or attempt != job.attempt:  # ended, or from the engine it left
            return
        if isinstance(item, BaseException):
            return self._retry_or_fail(job, item)
        started = choice.first_token_time is not None
        try:
            delta = choice.consume(item)
        except ChoiceFailed as e:
            return self._retry_or_fail(job, e)
        job.started = True
        if delta.token_ids and not started:
            assert job.ticket is not None
            job.ticket.release_one(len(choice.prompt_token_ids))
            if job.first_token_time is None:
                job.first_token_time = choice.first_token_time
        if delta.finish_reason is not None:
            job.remaining -= 1
            if item.finish_reason is None:  # a stop string: the engine would go on
                assert job.engine is not None
                job.engine.cancel([choice.request_id])
        if job.stream:
            assert job.formatter is not None
            chunk = job.formatter.chunk(delta, last=job.remaining == 0)
            if chunk is not None:
                job.outbox.append(sse(chunk))
        if job.remaining == 0:
            self._end(job)
        job.wakeup.set()

    def _end(self, job: Job) -> None:
        if job.stream:
            if job.include_usage:
                assert job.formatter is not None
                job.outbox.append(sse(job.formatter.usage_chunk()))
            job.outbox.append(DONE)
        job.ended = True

    def _retry_or_fail(self, job: Job, error: BaseException) -> None:
        if job.started or job.attempt >= self.retries or not _retriable(error):
            return self._fail(job, error)
        old = job.engine
        assert old is not None
        try:
            new = self.router.pick(job.prompts[0], exclude=old)
        except APIError:  # no other engine: the error stands
            return self._fail(job, error)
        if not _takes_what(new.ready, old.ready):
            self.router.release(new)
            return self._fail(job, error)
        old.cancel([c.request_id for c in job.choices])
        self.router.release(old)
        job.engine, job.engine_address = new, new.address
        job.attempt += 1
        self.num_retries += 1
        logger.info("%s: %s; sent to %s instead (retry %d)", job.request_id, error,
                    new.address, job.attempt)
        self._send(job)

    def _fail(self, job: Job, error: BaseException) -> None:
        job.error = as_api_error(error)
        if job.stream:  # the stream has started: the error is its last event
            job.outbox.append(sse(job.error.body()))
            job.outbox.append(DONE)
        job.ended = True
        job.wakeup.set()

    def _expire(self, job: Job) -> None:
        assert job.deadline is not None  # armed only then
        timeout = job.deadline - job.received
        self._fail(job, APIError(504, f"the request did not finish within {timeout:g} s (the "
                                      f"server's request timeout)", code="request_timeout"))


def _takes_what(new: Ready, old: Ready) -> bool:
    """Whether an engine with limits ``new`` accepts every request validated against
    ``old``'s (engines of one deployment normally have the same)."""
    return new.max_model_len >= old.max_model_len and new.vocab_size == old.vocab_size


def _retriable(error: BaseException) -> bool:
    """Whether the engine, not the request, is why it did not run: refused while
    draining, died, or aborted it on its own."""
    if isinstance(error, EngineRequestError):
        return error.kind is RequestErrorKind.OVERLOADED
    if isinstance(error, ChoiceFailed):
        return error.reason is FinishReason.ABORT
    return isinstance(error, EngineDeadError)


async def events(job: Job):
    """A streamed job's SSE bytes, everything waiting sent as one write, until its
    last event."""
    while True:
        await job.wakeup.wait()
        job.wakeup.clear()
        data = job.take()
        if data:
            yield data
        if job.ended and not job.outbox:
            return


def as_api_error(error: BaseException) -> APIError:
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
        return APIError(503, str(error), code="request_aborted", headers={"Retry-After": "1"})
    return APIError(500, f"internal error: {type(error).__name__}: {error}")
