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
"""

from __future__ import annotations

import asyncio
import functools
from typing import Union

import msgspec

from common.protocol import FinishReason, RequestOutput
from engine_worker.client import EngineDeadError, EngineRequestError
from frontend.choice import Choice, ChoiceFailed
from frontend.errors import APIError
from frontend.job import Job

_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"


def sse(body: dict) -> bytes:
    return b"data: " + _encode(body) + b"\n\n"


class OutputProcessor:
    def submit(self, job: Job) -> None:
        """Send the job's engine requests, each with this processor as its receiver,
        and arm its deadline."""
        engine = job.engine
        assert engine is not None and job.formatter is not None
        job.remaining = len(job.choices)
        if job.stream:
            job.outbox.extend(sse(chunk) for chunk in job.formatter.first_chunks())
        job.submitted = True
        for choice, params in zip(job.choices, job.params):
            engine.submit(choice.request_id, choice.prompt_token_ids, params,
                          functools.partial(self._on_output, job, choice))
        if job.deadline is not None:
            job.timer = asyncio.get_running_loop().call_at(
                job.deadline, self._expire, job)
        job.wakeup.set()

    def _on_output(self, job: Job, choice: Choice,
                   item: Union[RequestOutput, BaseException]) -> None:
        """One engine output (or the error that ends the request) of one choice."""
        if job.ended:
            return
        if isinstance(item, BaseException):
            return self._fail(job, item)
        started = choice.first_token_time is not None
        try:
            delta = choice.consume(item)
        except ChoiceFailed as e:
            return self._fail(job, e)
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
