"""Mid-stream failover carries every piece of a request's output-dependent state.

One ``roseserve serve`` stack with one engine; its streams are run once as they are
(the reference), then again while the engine is killed twice in a row (SIGKILL, from a
fault that fires when a request's output reaches a set length: the seam falls at a
known token). Each stream waits for the restarted engine and continues as a
continuation. Each test below compares one kind of request with its reference and
fails if that kind's state does not cross the seam: the frontend's stop-string match
and logprobs numbering, the engine's penalty counts, grammar state and seeded draws,
every choice of n>1 and of best_of, a response not streamed, the usage. A request whose failovers run out ends with the error
event.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import pytest

import processes

MAX_TOKENS = 48
FIRST_KILL_AT = 20   # the leading request's output length at the first kill...
SECOND_KILL_AT = 32  # ...and the longest output at the second
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


@dataclass
class Choice:
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    tokens: list = field(default_factory=list)          # logprobs: tokens,
    token_logprobs: list = field(default_factory=list)  # their logprobs,
    text_offset: list = field(default_factory=list)     # where each starts
    top_logprobs: list = field(default_factory=list)


@dataclass
class Result:
    choices: dict = field(default_factory=dict)
    usage: Optional[dict] = None
    error: Optional[dict] = None
    done: bool = False   # data: [DONE] arrived

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())


async def stream(client: httpx.AsyncClient, url: str, body: dict, out: Result) -> Result:
    if not body["stream"]:
        r = await client.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        reply = r.json()
        out.usage, out.done = reply["usage"], True
        for c in reply["choices"]:
            out.choices[c["index"]] = Choice(c["text"], c["token_ids"], c["finish_reason"])
        return out
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.done = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            out.error = chunk.get("error", out.error)
            out.usage = chunk.get("usage") or out.usage
            for c in chunk.get("choices", []):
                mine = out.choices.setdefault(c["index"], Choice())
                mine.text += c.get("text", "")
                mine.token_ids += c.get("token_ids") or []
                mine.finish_reason = c.get("finish_reason") or mine.finish_reason
                for key, values in (c.get("logprobs") or {}).items():
                    getattr(mine, key).extend(values)
    return out


def body(prompt: list[int], **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "temperature": 0.0, **kw,
            **({"stream_options": {"include_usage": True}} if kw.get("stream", True) else {})}


# The requests, one per piece of state, each a distinct prompt. "stop" leads: it starts
# first, so the first kill falls when its output is FIRST_KILL_AT long.
BODIES = {
    "stop": body([11, 12, 13]),
    "penalties": body([21, 22, 23], frequency_penalty=1.5, presence_penalty=1.0,
                      repetition_penalty=1.5),
    "logprobs": body([31, 32, 33], logprobs=3),
    "json_schema": body([41, 42, 43], response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}),
    "seeded": body([51, 52, 53], temperature=1.0, top_p=0.9, seed=7),
    "n2": body([61, 62, 63], temperature=1.0, seed=3, n=2),
    "greedy": body([71, 72, 73]),
    "whole": body([81, 82, 83], stream=False),   # (not streamed: the response whole)
    "best_of": body([91, 92, 93], stream=False, temperature=1.0, seed=5, best_of=3),
}


async def run(url: str, bodies: dict, die_file=None, kills=()) -> dict[str, Result]:
    """The streams (bodies' first one started alone, the others once it streams); each
    of ``kills`` written to ``die_file`` in turn, the next once the last killed."""
    results = {name: Result() for name in bodies}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=50)) as client:
        names = list(bodies)
        lead = asyncio.create_task(stream(client, url, bodies[names[0]], results[names[0]]))
        started = time.monotonic()
        while not results[names[0]].num_tokens:
            assert time.monotonic() - started < 60 and not lead.done(), results
            await asyncio.sleep(0.01)
        tasks = [lead] + [asyncio.create_task(stream(client, url, bodies[n], results[n]))
                          for n in names[1:]]
        while kills and not all(r.num_tokens for n, r in results.items()
                                if bodies[n]["stream"]):   # (all under way)
            assert time.monotonic() - started < 60, results
            await asyncio.sleep(0.01)
        for n in kills:
            with open(die_file, "w") as f:
                f.write(str(n))
            while os.path.exists(die_file):   # (the fault removes it as it kills)
                assert time.monotonic() - started < 60, "the engine was not killed"
                await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
    return results


@pytest.fixture(scope="module")
def failed_over(tiny_llama_dir, tmp_path_factory):
    """(reference, failed over, failovers counted, the stop request's text before its
    stop string): the streams as they run, then with two kills of the engine."""
    tmp = tmp_path_factory.mktemp("failover")
    die_file = tmp / "die"
    stack = processes.Serve(tiny_llama_dir, tmp / "serve.log", env={
        "ROSESERVE_FAULT_STEP_DELAY_S": "0.05", "ROSESERVE_FAULT_DIE_FILE": str(die_file)})
    try:
        stack.wait_ready()
        reference = asyncio.run(run(stack.url, BODIES))
        # A stop string of the lead's reference text that spans the seam: its first two
        # tokens arrive before the kill (FIRST_KILL_AT - 1 tokens have), its last two
        # after; the part before the kill is held back, and must stay held.
        offsets = asyncio.run(run(stack.url, {"stop": {**BODIES["stop"], "logprobs": 0}})
                              )["stop"].choices[0].text_offset
        text = reference["stop"].choices[0].text
        start, end = offsets[FIRST_KILL_AT - 3], offsets[FIRST_KILL_AT + 1]
        stop = text[start:end]
        assert text.find(stop) == start and len(stop) > 2, (text, stop)
        bodies = {**BODIES, "stop": {**BODIES["stop"], "stop": [stop]}}
        results = asyncio.run(run(stack.url, bodies, die_file, [FIRST_KILL_AT, SECOND_KILL_AT]))
        assert stack.log().count("injected SIGKILL") == 2, stack.log()
        failovers = processes.metric(stack.url, "roseserve_request_failovers_total")
        yield reference, results, failovers, text[:start]
    finally:
        assert stack.stop() == 0, stack.log()


def same_output(name: str, reference: dict, results: dict) -> None:
    got, want = results[name], reference[name]
    assert got.error is None and got.done, got
    assert {i: c.token_ids for i, c in got.choices.items()} == \
        {i: c.token_ids for i, c in want.choices.items()}
    assert {i: (c.text, c.finish_reason) for i, c in got.choices.items()} == \
        {i: (c.text, c.finish_reason) for i, c in want.choices.items()}
    assert got.usage == want.usage


def test_every_stream_failed_over_at_both_kills_but_the_stopped_one(failed_over):
    _, results, failovers, _ = failed_over
    assert failovers == 2 * len(BODIES) - 1   # (the stop string ended "stop" in between)
    assert all(r.error is None and r.done for r in results.values()), results


@pytest.mark.parametrize("name", ["greedy", "seeded", "penalties", "json_schema", "n2",
                                  "whole", "best_of"])
def test_output_continues_exactly_as_without_the_kills(failed_over, name):
    reference, results, _, _ = failed_over
    same_output(name, reference, results)
    assert len(results[name].choices) == (2 if name == "n2" else 1)   # (best_of: its best)
    assert len(results[name].choices[0].token_ids) == MAX_TOKENS


def test_a_stop_string_spanning_the_seam_ends_the_text_before_it(failed_over):
    reference, results, _, before = failed_over
    got = results["stop"]
    assert got.error is None and got.done
    assert (got.choices[0].text, got.choices[0].finish_reason) == (before, "stop")


def test_logprobs_are_numbered_across_the_seams(failed_over):
    reference, results, _, _ = failed_over
    same_output("logprobs", reference, results)
    got, want = results["logprobs"].choices[0], reference["logprobs"].choices[0]
    assert got.tokens == want.tokens and got.text_offset == want.text_offset
    assert len(got.text_offset) == MAX_TOKENS
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-3)


def test_a_request_whose_failovers_run_out_ends_with_the_error_event(tiny_llama_dir, tmp_path):
    """--request-retries 1: the first kill is failed over, the second ends the stream
    with the error event, after the tokens sent before it."""
    die_file = tmp_path / "die"
    stack = processes.Serve(tiny_llama_dir, tmp_path / "serve.log", "--request-retries", "1",
                            env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.05",
                                 "ROSESERVE_FAULT_DIE_FILE": str(die_file)})
    try:
        stack.wait_ready()
        got = asyncio.run(run(stack.url, {"greedy": BODIES["greedy"]}, die_file, [8, 16]))
        result = got["greedy"]
        assert result.num_tokens == 15, result   # (the 16th was not sent)
        assert result.error is not None and result.error["code"] == "engine_unavailable"
        assert "failover 1)" in stack.log() and "failover 2)" not in stack.log()
    finally:
        assert stack.stop() == 0, stack.log()
