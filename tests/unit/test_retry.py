"""Drain, retry and failover in the frontend: the router skips a draining engine, a
job whose engine refused it (draining) or failed before any output is sent whole to
another engine, and one whose engine failed mid-stream continues on another, each
unseen by its client. The real router, output processor, job and
choices; the engines are fakes that record what they were sent and answer as a test
tells them (the end-to-end rolling restart is in test_reliability.py)."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest

from common.protocol import (CacheEvents, FinishReason, Ready, RequestError, RequestErrorKind,
                             RequestOutput, SamplingParams)
from common.tokenizer import load_tokenizer
from common.prefix_hash import prefix_hashes
from engine_worker.client import CacheView, EngineDeadError, EngineRequestError, StoreView
from frontend.admission import Admission
from frontend.choice import Choice
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher
from frontend.errors import APIError
from frontend.job import Job
from frontend.output_processor import OutputProcessor
from frontend.router import EngineRouter

PROMPT = [5, 6, 7, 8, 9]


class FakeEngine:
    """What the router and the output processor use of an EngineClient."""

    def __init__(self, name: str, max_model_len: int = 512, role: str = "mixed",
                 kv_store: bool = False) -> None:
        self.address = f"fake://{name}"
        self.ready = Ready(engine_id=name, protocol_version=1, model_name="tiny",
                           max_model_len=max_model_len, vocab_size=1000, num_kv_blocks=64,
                           block_size=4, eos_token_ids=[2], role=role, kv_store=kv_store)
        self.dead_reason: Optional[str] = None
        self.draining = False
        self.sinks: dict = {}
        self.submitted: list[str] = []
        # What each submission asked for: its params and disaggregation fields.
        self.sent: list[tuple[SamplingParams, dict]] = []
        self.cancelled: list[str] = []
        self.cache = CacheView()

    @property
    def accepting(self) -> bool:
        return self.dead_reason is None and not self.draining

    def submit(self, request_id, prompt_token_ids, params, sink, **disaggregation) -> None:
        self.check_alive()
        self.submitted.append(request_id)
        self.sent.append((params, disaggregation))
        self.sinks[request_id] = sink

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def cancel(self, request_ids) -> None:
        for r in request_ids:
            self.cancelled.append(r)
            self.sinks.pop(r, None)

    # -- what the test makes the engine do --------------------------------------

    def refuse(self, message="the engine is shutting down",
               kind=RequestErrorKind.OVERLOADED) -> None:
        for request_id in list(self.sinks):
            sink = self.sinks.pop(request_id, None)  # a retry may have cancelled it
            if sink is not None:
                sink(EngineRequestError(RequestError(request_id=request_id, message=message,
                                                     kind=kind)))

    def die(self) -> None:
        self.dead_reason = "lost the connection"
        sinks, self.sinks = self.sinks, {}
        for sink in sinks.values():
            sink(EngineDeadError(self.dead_reason))

    def emit(self, tokens: list[int], finish: Optional[FinishReason] = None,
             error: Optional[str] = None, stop_token_id: Optional[int] = None) -> None:
        for request_id, sink in list(self.sinks.items()):
            if finish is not None:
                del self.sinks[request_id]
            sink(RequestOutput(request_id=request_id, new_token_ids=tokens,
                               finish_reason=finish, error=error, stop_token_id=stop_token_id))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir).backend_tokenizer


def run_job(tokenizer, engines: list[FakeEngine], retries: int = 2, n: int = 1,
            first: int = 0, min_prefill_tokens: int = 0, failover_timeout_s: float = 30.0):
    """A non-streamed job of ``n`` choices sent to ``engines[first]`` (and to a prefill
    engine when there is one), with the router's and processor's state to inspect."""
    router = EngineRouter(engines, policy="least-loaded", min_prefill_tokens=min_prefill_tokens)
    processor = OutputProcessor(router, retries, failover_timeout_s=failover_timeout_s)
    released = []
    job = Job(request_id="cmpl-t", created=0, model="tiny", received=0.0, stream=False,
              on_close=lambda j: released.append(j.engine))
    job.prompts = [list(PROMPT)]
    job.ticket = Admission(16, 1000).admit(n, n * len(PROMPT))
    for i in range(n):
        job.choices.append(Choice(
            index=i, request_id=f"cmpl-t-{i}", prompt_token_ids=list(PROMPT),
            detokenizer=IncrementalDetokenizer(tokenizer, PROMPT), stops=StopStringMatcher([]),
            eos_token_ids=frozenset([2])))
        job.params.append(SamplingParams(max_tokens=3))
    for e in engines[:first]:
        e.draining = True  # the pick lands on engines[first]
    job.engine, job.prefill = router.route(PROMPT)
    job.prefill_held = job.prefill is not None
    for e in engines[:first]:
        e.draining = False
    job.formatter = object()  # a full response: nothing is formatted before it ends
    processor.submit(job)
    return job, router, processor


def load(router: EngineRouter) -> list[int]:
    return [e.load for e in router.engines]


def finish(engine: FakeEngine) -> None:
    engine.emit([11, 12])
    engine.emit([13], FinishReason.LENGTH)


async def _in_loop(fn):
    return fn()


def in_loop(fn):
    """``fn`` run inside an event loop (submit arms no timer without a deadline, but
    the job's Event wants a loop on older Pythons)."""
    return asyncio.run(_in_loop(fn))


def test_the_router_skips_a_draining_engine_and_refuses_when_all_drain():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = EngineRouter([a, b], policy="least-loaded")
    a.draining = True
    assert [router.pick(PROMPT) for _ in range(3)] == [b, b, b]
    b.draining = True
    with pytest.raises(APIError) as e:
        router.pick(PROMPT)
    assert e.value.status == 503
    assert "fake://a: draining; fake://b: draining" in e.value.message


def test_round_robin_takes_the_healthy_engines_in_turn():
    a, b, c = FakeEngine("a"), FakeEngine("b"), FakeEngine("c")
    router = EngineRouter([a, b, c], policy="round-robin")
    assert [router.pick(PROMPT) for _ in range(4)] == [a, b, c, a]   # loads ignored
    b.draining = True
    assert [router.pick(PROMPT) for _ in range(3)] == [a, c, a]


def test_blocks_in_the_kv_store_count_as_held_by_every_engine_that_uses_it():
    a, b = FakeEngine("a", kv_store=True), FakeEngine("b", kv_store=True)
    c = FakeEngine("c")                                     # uses no store
    store = StoreView()
    router = EngineRouter([a, b, c], policy="prefix", store=store)
    long = list(range(10, 30))                              # 5 full blocks
    hashes = prefix_hashes(long, 4, 100)
    a.cache.apply(CacheEvents(seq=1, stored=hashes[:2], snapshot=True), 0.0)
    assert [e.matched_blocks(hashes, store) for e in router.engines] == [2, 0, 0]
    store.apply(CacheEvents(seq=1, store_put=hashes[:4]))   # puts, as an engine reports them
    assert [e.matched_blocks(hashes, store) for e in router.engines] == [4, 4, 0]
    assert router.pick([1, 2, 3]) is a                      # (a busy now)
    assert router.pick(long) is b                           # a tie: the least loaded
    store.apply(CacheEvents(seq=2, store_lost=True))        # an engine lost the store
    assert store.held == {} and c.cache.held == set()


def test_a_request_refused_by_a_draining_engine_completes_on_another(tokenizer):
    def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        job, router, processor = run_job(tokenizer, [a, b], n=2)
        assert a.submitted == ["cmpl-t-0", "cmpl-t-1"] and load(router) == [1, 0]
        a.refuse()  # both choices refused: one retry of the whole job
        assert b.submitted == ["cmpl-t-0", "cmpl-t-1"]
        assert job.engine is b and job.attempt == 1 and processor.num_retries == 1
        assert load(router) == [0, 1]
        finish(b)
        return job
    job = in_loop(scenario)
    assert job.ended and job.error is None
    assert job.ticket.admission.requests == 0  # each choice gave its share back once
    assert [c.token_ids for c in job.choices] == [[11, 12, 13]] * 2
    assert [c.finish_reason for c in job.choices] == ["length"] * 2


def test_a_request_whose_engine_died_before_any_output_moves(tokenizer):
    def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        job, router, processor = run_job(tokenizer, [a, b])
        a.die()
        assert job.engine is b and processor.num_retries == 1
        finish(b)
        return job
    job = in_loop(scenario)
    assert job.error is None and job.choices[0].token_ids == [11, 12, 13]


def test_an_engine_abort_before_any_output_moves_but_an_error_of_its_own_does_not(tokenizer):
    def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        moved, _, _ = run_job(tokenizer, [a, b])
        a.emit([], FinishReason.ABORT, "the engine is shutting down")
        assert moved.engine is b and not moved.ended
        c, d = FakeEngine("c"), FakeEngine("d")
        failed, _, processor = run_job(tokenizer, [c, d])
        c.emit([], FinishReason.ERROR, "non-finite logits")
        assert failed.engine is c and processor.num_retries == 0 and d.submitted == []
        e, f = FakeEngine("e"), FakeEngine("f")
        invalid, _, processor = run_job(tokenizer, [e, f])
        e.refuse("prompt too long", RequestErrorKind.INVALID)
        assert invalid.engine is e and processor.num_retries == 0 and f.submitted == []
        return failed, invalid
    failed, invalid = in_loop(scenario)
    assert failed.error.status == 500 and "non-finite logits" in failed.error.message
    assert invalid.error.status == 400 and invalid.error.message == "prompt too long"


def test_a_request_that_streamed_tokens_continues_on_another_engine(tokenizer):
    """Failover: each unfinished choice goes on as a continuation of the tokens read
    (its prompt logprobs not asked again), a finished one stays finished; the result
    is whole, each token once."""
    def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        job, router, processor = run_job(tokenizer, [a, b], n=2)
        job.params[0] = SamplingParams(max_tokens=3, prompt_logprobs=1)
        a.sinks.pop("cmpl-t-1")(RequestOutput(request_id="cmpl-t-1", new_token_ids=[21, 22, 23],
                                              finish_reason=FinishReason.LENGTH))
        a.emit([11])
        a.die()
        assert b.submitted == ["cmpl-t-0"] and load(router) == [0, 1]
        params, continuation = b.sent[0]
        assert continuation == {"output_token_ids": [11]} and params.prompt_logprobs is None
        assert processor.num_failovers == 1 and processor.num_retries == 0
        a.emit([99])   # (from the engine it left: not read)
        b.emit([12])
        b.emit([13], FinishReason.LENGTH)
        return job
    job = in_loop(scenario)
    assert job.ended and job.error is None
    assert [c.token_ids for c in job.choices] == [[11, 12, 13], [21, 22, 23]]


def test_failovers_stop_at_the_limit_and_when_no_engine_comes(tokenizer):
    def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        job, _, processor = run_job(tokenizer, [a, b], retries=1)
        a.emit([11])
        a.die()
        b.emit([12])
        b.die()   # (a second failover: over --request-retries 1)
        alone = FakeEngine("alone")
        single, _, p1 = run_job(tokenizer, [alone], failover_timeout_s=0.0)
        alone.emit([11])
        alone.die()   # (no engine within --failover-timeout)
        return job, processor, single, p1
    job, processor, single, p1 = in_loop(scenario)
    assert processor.num_failovers == 1 and job.error.status == 503
    assert "lost the connection" in job.error.message and job.choices[0].token_ids == [11, 12]
    assert p1.num_failovers == 0 and single.error.status == 503


def test_a_drain_past_its_timeout_fails_a_started_job_over(tokenizer):
    """The engine aborts a request it was streaming (its drain timed out): the job
    continues on another engine after the tokens read."""
    def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        job, router, processor = run_job(tokenizer, [a, b])
        a.emit([11])
        a.emit([], FinishReason.ABORT, error="the engine is shutting down")
        assert b.sent[0][1] == {"output_token_ids": [11]} and load(router) == [0, 1]
        b.emit([12, 13], FinishReason.LENGTH)
        return job, processor
    job, processor = in_loop(scenario)
    assert job.ended and job.error is None and processor.num_failovers == 1
    assert job.choices[0].token_ids == [11, 12, 13]


def test_a_failover_refuses_an_engine_with_a_shorter_context(tokenizer):
    """The only engine left could not take every request validated against the dead
    one's limits: the stream ends with the error, and nothing stays counted."""
    def scenario():
        a, short = FakeEngine("a"), FakeEngine("short", max_model_len=64)
        job, router, processor = run_job(tokenizer, [a, short])
        a.emit([11])
        a.die()
        return job, router, processor, short
    job, router, processor, short = in_loop(scenario)
    assert job.error is not None and job.error.status == 503
    assert processor.num_failovers == 0 and short.submitted == [] and load(router) == [0, 0]


def test_retries_stop_at_the_limit_and_with_no_other_engine(tokenizer):
    def scenario():
        engines = [FakeEngine(x) for x in "abcd"]
        job, router, processor = run_job(tokenizer, engines, retries=2)
        for e in engines[:3]:
            e.refuse()
        assert [len(e.submitted) for e in engines] == [1, 1, 1, 0]
        assert processor.num_retries == 2 and load(router) == [0, 0, 1, 0]
        alone = FakeEngine("alone")
        single, router1, p1 = run_job(tokenizer, [alone])
        alone.die()
        return job, single, p1
    job, single, p1 = in_loop(scenario)
    assert job.error.status == 503 and job.error.message == "the engine is shutting down"
    assert single.error.status == 503 and p1.num_retries == 0


def test_a_retry_skips_an_engine_with_a_shorter_context(tokenizer):
    def scenario():
        a, short = FakeEngine("a"), FakeEngine("short", max_model_len=64)
        job, router, processor = run_job(tokenizer, [a, short])
        a.refuse()
        return job, router, processor, short
    job, router, processor, short = in_loop(scenario)
    assert job.error is not None and processor.num_retries == 0
    assert short.submitted == [] and load(router) == [1, 0]


def test_outputs_from_the_engine_a_job_left_are_ignored(tokenizer):
    def scenario():
        a, b = FakeEngine("a"), FakeEngine("b")
        job, router, processor = run_job(tokenizer, [a, b], n=2)
        sink = a.sinks["cmpl-t-1"]  # a dead engine fails each request it held, in turn
        a.sinks["cmpl-t-0"](EngineDeadError("gone"))
        assert job.engine is b and a.cancelled == ["cmpl-t-0", "cmpl-t-1"]
        sink(EngineDeadError("gone"))  # the old attempt's second failure: ignored
        sink(RequestOutput(request_id="cmpl-t-1", new_token_ids=[99]))
        finish(b)
        return job
    job = in_loop(scenario)
    assert job.error is None and [c.token_ids for c in job.choices] == [[11, 12, 13]] * 2


def test_an_engine_that_died_between_the_pick_and_the_send_is_left_for_another(tokenizer):
    """The pick and the send are in different turns of the event loop (the request's
    preparation ends in between): the engine may be found dead at the send."""
    class DiesBeforeTheSend(FakeEngine):
        def submit(self, *args, **kwargs) -> None:
            raise EngineDeadError("lost the connection")

    def scenario():
        a, b = DiesBeforeTheSend("a"), FakeEngine("b")
        job, router, processor = run_job(tokenizer, [a, b])
        assert job.engine is b and load(router) == [0, 1]
        finish(b)
        lone, _, _ = run_job(tokenizer, [DiesBeforeTheSend("lone")])
        return job, lone
    job, lone = in_loop(scenario)
    assert job.error is None and job.choices[0].token_ids == [11, 12, 13]
    assert lone.ended and lone.error.status == 503


# -- prefill/decode disaggregation ---------------------------------------------------

def pd_job(tokenizer, min_prefill_tokens: int = 0):
    p, d = FakeEngine("p", role="prefill"), FakeEngine("d", role="decode")
    job, router, processor = run_job(tokenizer, [p, d], min_prefill_tokens=min_prefill_tokens)
    return p, d, job, router


def test_the_first_token_comes_from_the_prefill_engine_the_rest_from_the_decode_engine(
        tokenizer):
    def scenario():
        p, d, job, router = pd_job(tokenizer)
        assert job.engine is d and job.prefill is p and load(router) == [1, 1]
        [(params, kw)] = p.sent
        assert params.max_tokens == 1 and kw == {"kv_lease_s": 30.0}
        assert d.submitted == []
        p.emit([11], FinishReason.LENGTH)
        assert load(router) == [0, 1]  # the prefill engine is done with it
        [(params, kw)] = d.sent
        assert params.max_tokens == 3 and kw["output_token_ids"] == [11]
        assert kw["kv_source"].address == "fake://p"
        assert kw["kv_source"].request_id == "cmpl-t-0"
        d.emit([12])
        d.emit([13], FinishReason.LENGTH)
        return job
    job = in_loop(scenario)
    assert job.error is None and job.choices[0].token_ids == [11, 12, 13]
    assert job.choices[0].finish_reason == "length"
    assert job.timing()["prefill_engine"] == "fake://p"


def test_a_first_token_that_ends_the_request_lets_go_of_the_prefill_engines_blocks(tokenizer):
    def scenario():
        p, d, job, router = pd_job(tokenizer)
        p.emit([2], FinishReason.STOP, stop_token_id=2)  # EOS
        assert d.submitted == [] and p.cancelled == ["cmpl-t-0"]
        assert load(router) == [0, 1]
        return job
    job = in_loop(scenario)
    assert job.ended and job.error is None and job.choices[0].finish_reason == "stop"


def test_a_prefill_engine_failing_before_its_token_leaves_it_all_to_the_decode_engine(
        tokenizer):
    def scenario():
        p, d, job, router = pd_job(tokenizer)
        p.die()
        [(params, kw)] = d.sent
        assert params.max_tokens == 3 and kw == {}  # computed whole, nothing pulled
        assert load(router) == [0, 1]
        finish(d)
        return job
    job = in_loop(scenario)
    assert job.error is None and job.choices[0].token_ids == [11, 12, 13]
    assert "prefill_engine" not in job.timing()


def test_the_decode_engine_dying_before_the_first_token_moves_the_job(tokenizer):
    def scenario():
        p, d, job, router = pd_job(tokenizer)
        d.dead_reason = "lost the connection"  # it had nothing of the job's yet
        p.emit([11], FinishReason.LENGTH)
        # Nothing was read: the job goes whole to the only engine left.
        assert job.engine is p and job.prefill is None and job.attempt == 1
        assert p.sent[-1] == (SamplingParams(max_tokens=3), {})
        finish(p)
        return job
    job = in_loop(scenario)
    assert job.error is None and job.choices[0].token_ids == [11, 12, 13]


def test_prompts_the_decode_engine_mostly_holds_skip_the_prefill_engine(tokenizer):
    def scenario():
        p, d, job, router = pd_job(tokenizer, min_prefill_tokens=len(PROMPT) + 1)
        assert job.prefill is None and p.submitted == [] and d.submitted == ["cmpl-t-0"]
        assert load(router) == [0, 1]
        finish(d)
        return job
    assert in_loop(scenario).error is None
