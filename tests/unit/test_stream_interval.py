"""--stream-interval: a stream's events wait in its outbox until that many tokens are
among them, except its first token and its end, and none is lost. The real output
processor, job, choice and formatter; the engine is test_retry's fake."""

from __future__ import annotations

import asyncio

import pytest

from common.protocol import FinishReason, SamplingParams
from common.tokenizer import load_tokenizer
from frontend.admission import Admission
from frontend.choice import Choice
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher
from frontend.job import Job
from frontend.output_processor import OutputProcessor
from frontend.formatters import CompletionFormatter
from frontend.router import EngineRouter
from test_retry import PROMPT, FakeEngine


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir).backend_tokenizer


def stream(tokenizer, interval: int, tokens: int) -> tuple[list[bool], list[bytes]]:
    """A streamed job fed ``tokens`` outputs of one token each (the last one finishing
    it): after each, whether the job woke its writer, and what the writer took."""
    async def run():
        engine = FakeEngine("e")
        processor = OutputProcessor(EngineRouter([engine], policy="least-loaded"), 0,
                                    stream_interval=interval)
        job = Job(request_id="cmpl-s", created=0, model="tiny", received=0.0, stream=True,
                  on_close=lambda j: None)
        job.prompts = [list(PROMPT)]
        job.ticket = Admission(16, 1000).admit(1, len(PROMPT))
        job.choices.append(Choice(
            index=0, request_id="cmpl-s-0", prompt_token_ids=list(PROMPT),
            detokenizer=IncrementalDetokenizer(tokenizer, PROMPT), stops=StopStringMatcher([]),
            eos_token_ids=frozenset()))
        job.params.append(SamplingParams(max_tokens=tokens))
        job.engine = engine
        job.formatter = CompletionFormatter(job, lambda t: tokenizer.decode([t]))
        processor.submit(job)
        job.wakeup.clear()
        woke, writes = [], []
        for i in range(tokens):
            engine.emit([300 + i], FinishReason.LENGTH if i == tokens - 1 else None)
            woke.append(job.wakeup.is_set())
            if job.wakeup.is_set():
                job.wakeup.clear()
                writes.append(job.take())
        assert job.ended and not job.outbox
        return woke, writes

    return asyncio.run(run())


def test_a_stream_is_written_every_interval_tokens_and_at_its_ends(tokenizer):
    woke, writes = stream(tokenizer, interval=3, tokens=8)
    # The first token at once; then every third; the last one (it finishes) at once.
    assert woke == [True, False, False, True, False, False, True, True]
    events = [w.count(b"data: ") for w in writes]
    assert events == [1, 3, 3, 1 + 1]  # the last write: the last token and [DONE]
    assert writes[-1].endswith(b"data: [DONE]\n\n")
    assert b"".join(writes).count(b'"text"') == 8  # no token lost or repeated


def test_an_interval_of_one_writes_every_token(tokenizer):
    woke, writes = stream(tokenizer, interval=1, tokens=4)
    assert woke == [True] * 4 and [w.count(b"data: ") for w in writes] == [1, 1, 1, 2]
