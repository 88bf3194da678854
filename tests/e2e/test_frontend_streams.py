"""The HTTP frontend's streams end to end (real engine, tokenizer pool and frontend
processes): what an SSE client reads, whole text, usage as it goes, many at once, and
--stream-interval."""

from __future__ import annotations

import asyncio
import json

import httpx

# The module's stacks (fixtures, started once for this module) and their helpers.
from frontend_stacks import complete, sse_events, stack, strict, wait_engine_idle


def test_streamed_text_is_whole_utf8_and_matches_the_tokens(stack):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack["engine"].args[2])
    for seed in range(4):
        with httpx.stream("POST", stack["url"] + "/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": f"Text {seed}", "max_tokens": 24,
                "temperature": 1.0, "seed": seed, "stream": True,
                "return_token_ids": True}) as r:
            events = sse_events(r)
        chunks = [e for e in events if e != "[DONE]"]
        assert events[-1] == "[DONE]"
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert len(ids) == 24
        assert text == tok.decode(ids, skip_special_tokens=True)


def test_a_stream_is_an_uncached_event_stream(stack):
    """What proxies and SSE clients read: the type, and no caching or buffering."""
    with httpx.stream("POST", stack["url"] + "/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "Hi", "max_tokens": 3, "stream": True,
            "ignore_eos": True}) as r:
        events = sse_events(r)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-accel-buffering"] == "no"
    assert r.headers["transfer-encoding"] == "chunked"
    assert events[-1] == "[DONE]" and len(events) == 4  # role-less completion: 3 + DONE


def test_a_stream_interval_writes_tokens_a_few_at_a_time_and_loses_none(strict):
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 10, "ignore_eos": True,
            "temperature": 0}
    full = complete(strict["url"], strict["auth"], **body).json()
    reads = []  # what arrived at each read of the socket (20 ms apart: one per write)
    with httpx.stream("POST", strict["url"] + "/v1/completions", headers=strict["auth"],
                      json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        assert r.status_code == 200
        reads = list(r.iter_raw())
    events = [json.loads(line[6:]) for line in b"".join(reads).decode().splitlines()
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == \
        full["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == 10
    # The first token alone, then 3 at a time, the last ones with the end: 5 writes
    # (a token a write: 10).
    assert len([d for d in reads if b'"text"' in d]) <= 5, reads


def test_a_stream_interval_changes_no_choice_of_a_stream(stack, strict):
    """The same streamed chat (seeded sampling, logprobs, a stop string) through the
    main stack (interval 1) and the strict one (interval 3, one waiting request
    admitted: n 1): the text, logprobs and finish reason, and the usage, are the same."""
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12, "temperature": 0.8, "seed": 1, "logprobs": True,
            "top_logprobs": 2, "stop": ["ar"], "stream": True,
            "stream_options": {"include_usage": True}}

    def choices(url, headers=None):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=60) as r:
            assert r.status_code == 200
            events = [e for e in sse_events(r) if e != "[DONE]"]
        out: dict = {}
        for e in events:
            for c in e["choices"]:
                text, logprobs, finish = out.get(c["index"], ("", [], None))
                out[c["index"]] = (text + (c["delta"].get("content") or ""),
                                   logprobs + (c["logprobs"] or {}).get("content", []),
                                   c["finish_reason"] or finish)
        return out, events[-1]["usage"]

    got = choices(strict["url"], strict["auth"])
    assert got == choices(stack["url"])
    # The stop string ends the text in the 10th token: the last of the engine's fourth
    # output (1 token, then 3 at a time).
    (text, logprobs, finish), = got[0].values()
    assert finish == "stop" and len(logprobs) == 10 and not text.endswith("ar")


def test_many_concurrent_streams_complete_with_correct_usage(stack):
    async def one(client, i):
        body = {"model": "tiny-llama", "prompt": f"Request number {i}", "max_tokens": 16,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        events = []
        async with client.stream("POST", stack["url"] + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]
                  if json.loads(e)["choices"]]
        return usage, finish[-1]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client, i) for i in range(32)])

    results = asyncio.run(main())
    assert all(u["completion_tokens"] == 16 and f == "length" for u, f in results)
    assert all(u["prompt_tokens"] == u["total_tokens"] - 16 for u, _ in results)
    stats = wait_engine_idle(stack["engine"].address)
    assert stats.num_blocks_used == 0


def test_continuous_usage_counts_the_tokens_so_far_on_every_chunk(stack):
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", stack["url"] + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events.pop() == "[DONE]"
    final = events.pop()  # include_usage's own chunk, with no choices
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    prompt = final["usage"]["prompt_tokens"]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == prompt for e in events)
    assert all(e["usage"]["total_tokens"] == prompt + n for e, n in zip(events, counts))
    # The role chunk comes before any token; then each chunk counts what came so far.
    assert counts[0] == 0 and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert counts[1:] == sorted(counts[1:]) and counts[-1] == 6 and counts[1] >= 1
    # Without a stream there are no chunks for the options to shape: OpenAI refuses them.
    r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=60,
                   json={**body, "stream": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert "only allowed when stream is true" in r.json()["error"]["message"]
