"""From engine outputs to what each response sends.

The engine clients read one frame per engine step (an OutputBatch) as it arrives and
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

Failover: a job some of whose output was read when that happens (or that the engine
drained past its timeout, or whose engine was cut off) moves too, mid-stream: each
choice not finished continues on another engine, or on the same one restarted, as a
continuation (its prompt and every token read so far, as a decode engine takes a
prefill engine's first token): the engine carries what depends on the output (penalty
counts, min_tokens, the grammar's state, a seed's draws, the n-gram history), and the
choice here its text, stop strings and logprobs, so the client's stream goes on with
no error and no token twice or missing. It waits up to ``failover_timeout_s`` for an
engine that takes it (the only engine's restart), and counts toward ``retries``. An
error of the request's own (invalid, or failed in a step) is never retried.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Union

import msgspec

from common.protocol import (FinishReason, KvSource, Ready, RequestErrorKind, RequestOutput,
                             SamplingParams)
from engine_worker.client import EngineClient, EngineDeadError, EngineRequestError
from frontend.choice import Choice, ChoiceFailed
from frontend.errors import APIError
from frontend.job import Job
from frontend.router import EngineRouter

logger = logging.getLogger(__name__)

class OutputProcessor:
    def __init__(self, router: EngineRouter, retries: int, kv_lease_s: float = 30.0,
                 stream_interval: int = 1, failover_timeout_s: float = 30.0) -> None:
        self.router = router
        self.retries = retries
        # How long a started job waits for an engine to continue it on (failover).
        self.failover_timeout_s = failover_timeout_s
        # How long a prefill engine keeps a prompt's blocks for the decode engine.
        self.kv_lease_s = kv_lease_s
        # A job's waiting events are written once this many tokens are among them.
        self.stream_interval = stream_interval
        # Jobs sent to another engine since start (each time counts), before any
        # output (retries) and mid-stream (failovers).
        self.num_retries = 0
        self.num_failovers = 0

    def submit(self, job: Job) -> None:
        """Send the job's engine requests, each with this processor as its receiver,
        and arm its deadline."""
        assert job.formatter is not None
        job.remaining = len(job.choices)
        if job.stream:
            job.outbox.extend(map(job.formatter.event, job.formatter.first_chunks()))
        self._send(job)
        if job.deadline is not None:
            job.timer = asyncio.get_running_loop().call_at(
                job.deadline, self._expire, job)
        job.wakeup.set()

    def _send(self, job: Job) -> None:
        assert job.engine is not None
        job.submitted = True
        try:
            for choice, params in zip(job.choices, job.params):
                if job.prefill is None or not self._send_prefill(job, choice, params):
                    self._submit(job, choice, params)
            if job.num_prefilling == 0:  # none went to the prefill engine
                self.release_prefill(job)
        except EngineDeadError as e:  # it died since it was picked (before any choice went)
            self._retry_or_fail(job, e)

    def _submit(self, job: Job, choice: Choice, params: SamplingParams, **continuation) -> None:
        assert job.engine is not None
        if self.stream_interval > 1:
            continuation["output_interval"] = self.stream_interval
        job.engine.submit(choice.request_id, choice.prompt_token_ids, params,
                          functools.partial(self._on_output, job, choice, job.attempt),
                          **continuation)

    # -- prefill/decode disaggregation -------------------------------------------------
    #
    # A choice goes to the prefill engine for its prompt and first token only, and
    # the prefill engine keeps the prompt's KV blocks for a while (kv_lease_s). The
    # first token is handed on like any output; unless it ended the choice, the
    # decode engine then gets the request with that token, and pulls the blocks it
    # lacks from the prefill engine itself (engine_worker/kv_transfer.py), computing
    # whatever does not arrive intact. A prefill engine that fails or refuses the
    # choice before its first token means the decode engine computes it all.

    def _send_prefill(self, job: Job, choice: Choice, params: SamplingParams) -> bool:
        """Send a choice's prompt to the job's prefill engine; False if it is gone."""
        assert job.prefill is not None
        first_only = msgspec.structs.replace(params, max_tokens=1,
                                             min_tokens=min(params.min_tokens, 1))
        try:
            job.prefill.submit(choice.request_id, choice.prompt_token_ids, first_only,
                               functools.partial(self._on_prefill_output, job, choice, params,
                                                 job.attempt), kv_lease_s=self.kv_lease_s)
        except EngineDeadError:
            return False
        choice.prefill_engine = job.prefill.address
        job.num_prefilling += 1
        return True

    def _on_prefill_output(self, job: Job, choice: Choice, params: SamplingParams,
                           attempt: int, item: Union[RequestOutput, BaseException]) -> None:
        if job.ended or attempt != job.attempt:
            return
        if isinstance(item, RequestOutput) and item.finish_reason is None:
            return self._on_output(job, choice, attempt, item)  # prompt logprobs, say
        self._prefill_done(job)
        if _retriable(item) or (isinstance(item, RequestOutput)
                                and item.finish_reason is FinishReason.ABORT):
            logger.info("%s: the prefill engine %s did not compute it (%s); the decode "
                        "engine computes it all", choice.request_id, choice.prefill_engine,
                        getattr(item, "error", None) or item)
            choice.prefill_engine = None
            try:
                return self._submit(job, choice, params)
            except EngineDeadError as e:
                return self._retry_or_fail(job, e)
        if isinstance(item, BaseException) or not self._continues(job, choice, params, item):
            assert job.prefill is not None
            job.prefill.cancel([choice.request_id])  # its blocks are not wanted
            return self._on_output(job, choice, attempt, item)
        try:
            job.engine.check_alive()
        except EngineDeadError as e:  # nothing sent yet: the job may still move
            return self._retry_or_fail(job, e)
        self._on_output(job, choice, attempt, msgspec.structs.replace(item, finish_reason=None))
        if job.ended or choice.finish_reason is not None:  # a stop string ended it
            job.prefill.cancel([choice.request_id])
            return
        source = KvSource(address=job.prefill.address, request_id=choice.request_id)
        try:
            self._submit(job, choice, msgspec.structs.replace(params, prompt_logprobs=None),
                         output_token_ids=list(choice.token_ids), kv_source=source)
        except EngineDeadError as e:
            self._retry_or_fail(job, e)

    @staticmethod
    def _continues(job: Job, choice: Choice, params: SamplingParams,
                   out: RequestOutput) -> bool:
        """Whether a prefill engine's last output ended only because it was asked for
        one token: the request goes on at the decode engine."""
        assert job.engine is not None and job.engine.ready is not None
        done = len(out.new_token_ids)
        return (out.finish_reason is FinishReason.LENGTH and done == 1
                and (params.max_tokens is None or params.max_tokens > done)
                and len(choice.prompt_token_ids) + done < job.engine.ready.max_model_len)

    def _prefill_done(self, job: Job) -> None:
        job.num_prefilling -= 1
        if job.num_prefilling == 0:
            self.release_prefill(job)

    def release_prefill(self, job: Job) -> None:
        """The job's prefill engine no longer counts it toward its load."""
        if job.prefill_held:
            assert job.prefill is not None
            self.router.release(job.prefill)
            job.prefill_held = False

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
            job.outbox.extend(job.formatter.stream_delta(delta, last=job.remaining == 0))
        if job.remaining == 0:
            self._end(job)
        job.held += len(delta.token_ids)
        if (job.held >= self.stream_interval or not started or job.ended
                or delta.finish_reason is not None):
            job.held = 0
            job.wakeup.set()

    def _end(self, job: Job) -> None:
        if job.stream:
            assert job.formatter is not None
            job.outbox.extend(job.formatter.stream_end())
        job.ended = True

    def _retry_or_fail(self, job: Job, error: BaseException) -> None:
        if job.attempt >= self.retries or not _retriable(error):
            return self._fail(job, error)
        if job.started:
            return self._fail_over(job, error)
        old = job.engine
        assert old is not None
        try:
            new = self.router.pick(job.prompts[0], job.params[0].cache_salt, exclude=old,
                                   adapter=job.adapter)
        except APIError:  # no other engine: the error stands
            return self._fail(job, error)
        if not _takes_what(new.ready, old.ready):
            self.router.release(new)
            return self._fail(job, error)
        self._leave(job, [c.request_id for c in job.choices])
        for c in job.choices:  # the new engine computes it all
            c.prefill_engine = None
        job.engine, job.engine_address = new, new.address
        self.num_retries += 1
        logger.info("%s: %s; sent to %s instead (retry %d)", job.request_id, error,
                    new.address, job.attempt)
        self._send(job)

    def _leave(self, job: Job, request_ids: list[str]) -> None:
        """Take the job's requests ``request_ids`` off its engines (where they are
        alive: drained past their timeout), which no longer count it toward their load;
        what they still send is not read (the job's next attempt)."""
        assert job.engine is not None
        job.engine.cancel(request_ids)
        self.router.release(job.engine)
        if job.prefill is not None:
            job.prefill.cancel(request_ids)
            self.release_prefill(job)
            job.prefill, job.num_prefilling = None, 0
        job.attempt += 1

    def _fail_over(self, job: Job, error: BaseException) -> None:
        """Move a started job's unfinished choices off its engine (which failed it),
        to continue elsewhere (_continue)."""
        old = job.engine
        assert old is not None
        self._leave(job, [c.request_id for c in job.choices if c.finish_reason is None])
        job.engine = None
        loop = asyncio.get_running_loop()
        self._continue(job, error, old, loop.time() + self.failover_timeout_s)

    def _continue(self, job: Job, error: BaseException, old: "EngineClient",
                  deadline: float) -> None:
        """Send a failed-over job's unfinished choices to an engine that takes them, as
        continuations; until ``deadline``, waiting for one where none is up."""
        if job.ended:   # (its client left, or its request deadline passed, meanwhile)
            return
        loop = asyncio.get_running_loop()
        try:
            new = self.router.pick(job.prompts[0], job.params[0].cache_salt,
                                   adapter=job.adapter)
        except APIError:
            if loop.time() < deadline:
                loop.call_later(FAILOVER_POLL_S, self._continue, job, error, old, deadline)
                return
            return self._fail(job, error)
        if not _takes_what(new.ready, old.ready):
            self.router.release(new)
            return self._fail(job, error)
        job.engine, job.engine_address = new, new.address
        self.num_failovers += 1
        logger.warning("%s: %s; continued on %s after %s (failover %d)", job.request_id,
                       error, new.address, old.address, job.attempt)
        try:
            for choice, params in zip(job.choices, job.params):
                if choice.finish_reason is not None:
                    continue
                if choice.token_ids:
                    self._submit(job, choice, msgspec.structs.replace(params,
                                                                      prompt_logprobs=None),
                                 output_token_ids=list(choice.token_ids))
                else:
                    self._submit(job, choice, params)
        except EngineDeadError as e:   # (it died since it was picked)
            self._retry_or_fail(job, e)

    def _fail(self, job: Job, error: BaseException) -> None:
        job.error = as_api_error(error)
        if job.stream:  # the stream has started: the error is its last event
            assert job.formatter is not None
            job.outbox.extend(job.formatter.stream_error(job.error))
        job.ended = True
        job.wakeup.set()

    def _expire(self, job: Job) -> None:
        assert job.deadline is not None  # armed only then
        timeout = job.deadline - job.received
        self._fail(job, APIError(504, f"the request did not finish within {timeout:g} s (the "
                                      f"server's request timeout)", code="request_timeout"))


# How often a job failing over polls for an engine to take it, while none is up.
FAILOVER_POLL_S = 0.1


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
