"""The stacks the HTTP frontend's end-to-end tests run against (real engine, tokenizer
pool and frontend processes), and their helpers: a module's ``stack`` and ``strict``
fixtures start their processes once for that module."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import processes
from engine_worker.client import EngineClient
from tokenizer_worker.client import TokenizerClient

SLOW = "SLOW-TOKENIZE"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("stack")
    engine = processes.engine(tiny_llama_dir, f"ipc://{d}/engine.sock")
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{d}/tok.sock",
                                    env={"ROSESERVE_FAULT_SLOW_MARKER": SLOW})
    front = processes.frontend(tiny_llama_dir, engine.address, pool.address,
                               "--served-model-name", "tiny-llama")
    try:
        processes.wait_healthy(front)
        yield {"engine": engine, "pool": pool, "frontend": front, "url": front.url}
    finally:
        for p in (front, pool, engine):
            p.stop()


@pytest.fixture(scope="module")
def strict(tmp_path_factory, tiny_llama_dir, stack):
    """A second frontend with an API key, a small body limit, an admission limit of
    one waiting request, a stream interval of 3 tokens and one allowed web origin, before an engine that
    decodes one request at a time, slowly (20 ms per step, so that requests stay
    queued long enough to observe)."""
    d = tmp_path_factory.mktemp("strict")
    engine = processes.engine(tiny_llama_dir, f"ipc://{d}/engine.sock", "--max-batch-size", "1",
                              env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02"})
    front = processes.frontend(tiny_llama_dir, engine.address, stack["pool"].address,
                               "--served-model-name", "tiny-llama", "--api-key", "s3cret", "--max-body-bytes", "4096",
                               "--max-waiting-requests", "1", "--stream-interval", "3",
                               "--allowed-origins", "https://ui.example")
    try:
        processes.wait_healthy(front)
        yield {"engine": engine, "frontend": front, "url": front.url,
               "auth": {"Authorization": "Bearer s3cret"}}
    finally:
        for p in (front, engine):
            p.stop()


def ping(client_type, address: str):
    """One round trip through a service's loop, from a fresh client."""
    async def go():
        client = client_type(address)
        await client.start(30)
        try:
            return await client.ping()
        finally:
            await client.close()
    return asyncio.run(go())


def engine_stats(address: str):
    return ping(EngineClient, address).stats


def pool_jobs(address: str) -> int:
    return ping(TokenizerClient, address).num_jobs_total


def wait_engine_idle(address: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(address)
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def complete(url, headers=None, **body):
    body.setdefault("model", "tiny-llama")
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def chat_after_calls(url, question: list[dict], message: dict, tools: list[dict]):
    """The conversation sent on: the assistant's message with its tool calls given
    back, and a result for the first call (a template may check the calls' ids)."""
    history = question + [message, {"role": "tool", "content": "sunny",
                                    "tool_call_id": message["tool_calls"][0]["id"]}]
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": history, "tools": tools, "max_tokens": 2})


def forced_calls(url, body: dict, content: str, calls: list[tuple[str, dict]]
                 ) -> tuple[dict, list[dict]]:
    """A chat whose reply the body's grammar forces into tool calls, made whole and
    streamed: both give ``content`` and ``calls`` ((name, arguments) each), the stream
    the text first, then each call as it is generated (its arguments in pieces), ending
    with finish_reason tool_calls. Returns the whole reply's message and the stream's
    call deltas."""
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == content
    got = message["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in got] == calls
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={**body, "stream": True}) as s:
        events = sse_events(s)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content", "") for d in deltas) == content
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(streamed) > len(got)
    assert ["".join(c["function"]["arguments"] for c in streamed if c["index"] == i)
            for i in range(len(got))] == [c["function"]["arguments"] for c in got]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    return message, streamed
