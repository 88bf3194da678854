"""The HTTP frontend end to end: real engine, tokenizer pool and frontend processes."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

import processes
from benchmarks.stack import metric as parse_metric, scrape
from engine_worker.client import EngineClient
# The module's stacks (fixtures, started once for this module) and their helpers.
from frontend_stacks import (SLOW, complete, engine_stats, ping, pool_jobs, sse_events,
                             stack, strict, wait_engine_idle)
from tokenizer_worker.client import TokenizerClient

# -- the OpenAI client ----------------------------------------------------------------


def test_openai_client_completions(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    full = client.completions.create(model="tiny-llama", prompt="Once upon a time",
                                     max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == 4
    assert full.usage.total_tokens == 16
    timing = full.model_extra["timing"]
    assert set(timing) == {"tokenize_ms", "queue_ms", "prefill_ms", "ttft_ms", "engine"}
    assert timing.pop("engine") == stack["engine"].address
    assert all(v is not None and v >= 0 for v in timing.values())
    assert all(round(v, 3) == v for v in timing.values())  # milliseconds to the microsecond
    chunks = list(client.completions.create(model="tiny-llama", prompt="Once upon a time",
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert "timing" in chunks[-1].model_extra


def test_openai_client_chat(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 8
    assert len(choice.logprobs.content) == 8
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    # "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n" (the tiny model's template)
    assert full.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages,
                                                 max_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_fields_that_change_nothing_are_served_and_the_rest_refused(stack):
    # OpenAI's clients send store, metadata, service_tier, modalities, prompt_cache_key,
    # safety_identifier and reasoning_effort; where they ask for nothing this server
    # lacks, the answer is the one without them.
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key="unused")
    ask = dict(model="tiny-llama", messages=[{"role": "user", "content": "Hi!"}],
               max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**ask).choices[0].message.content
    served = client.chat.completions.create(
        **ask, store=False, metadata={f"k{i}": "v" * 512 for i in range(16)},
        service_tier="auto", modalities=["text"], prompt_cache_key="session-7",
        safety_identifier="user-7", reasoning_effort="high")   # (a template variable
    # this model's template does not read)
    assert served.choices[0].message.content == plain
    for field, value, fragment in [
            ("store", True, "keeps no completions"),
            ("service_tier", "flex", "one service tier; 'flex' is not it"),
            ("modalities", ["text", "audio"], "text only"),
            ("metadata", {f"k{i}": "v" for i in range(17)}, "at most 16 items"),
            ("metadata", {"k": "v" * 513}, "at most 512 characters"),
            ("reasoning_effort", "max", "'minimal', 'low', 'medium' or 'high'")]:
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(**ask, **{field: value})
        error = refused.value.body
        assert error["param"].split(".")[0] == field and fragment in error["message"], error


def test_every_response_carries_a_request_id_and_the_access_log_names_it(stack, strict):
    url = stack["url"]
    r = complete(url, headers={"X-Request-Id": "trace-42"}, prompt="Hi", max_tokens=3,
                 ignore_eos=True)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    traced = r.json()["id"]
    # Without one: the completion's id, streamed or not.
    r = complete(url, prompt="Hi", max_tokens=2)
    assert r.headers["x-request-id"] == r.json()["id"]
    r = complete(url, prompt="Hi", max_tokens=2, stream=True)
    assert r.headers["x-request-id"] == sse_events(r)[0]["id"]
    # Refused before any completion (here by validation, and by the key): a new id.
    r = complete(url, prompt="Hi", temperature=5)
    assert r.status_code == 400 and len(r.headers["x-request-id"]) == 32
    r = complete(strict["url"], headers={"X-Request-Id": "no-key"}, prompt="Hi")
    assert r.status_code == 401 and r.headers["x-request-id"] == "no-key"
    for bad in (b"x" * 129, b"two words", b"\xc3\xa9", b""):
        r = complete(url, headers={"X-Request-Id": bad}, prompt="Hi", max_tokens=1)
        assert r.status_code == 400, bad
        assert r.json()["error"]["code"] == "invalid_request_id"
        assert r.headers["x-request-id"] != bad.decode(errors="replace")
    r = httpx.get(url + "/v1/models", headers={"X-Request-Id": "models-1"}, timeout=30)
    assert r.headers["x-request-id"] == "models-1"
    # One line a request, naming both ids and what the completion took.
    deadline = time.monotonic() + 10
    while "request_id=models-1" not in stack["frontend"].output() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = stack["frontend"].output()
    assert ("POST /v1/completions 200 " in log and f"request_id=trace-42 id={traced} "
            f"prompt_tokens=1 completion_tokens=3 finish=length ttft=" in log), log[-3000:]
    assert "GET /v1/models 200 " in log and "GET /health" not in log


def test_n_choices_with_a_seed_differ_and_are_counted(stack):
    r = complete(stack["url"], prompt="Colors:", max_tokens=6, n=3, temperature=1.0, seed=7,
                 return_token_ids=True)
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1
    # "Colors:" is 3 GPT-2 tokens, counted once for the 3 choices.
    assert body["usage"]["completion_tokens"] == 18 and body["usage"]["prompt_tokens"] == 3
    again = complete(stack["url"], prompt="Colors:", max_tokens=6, n=3, temperature=1.0, seed=7,
                     return_token_ids=True).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]


def test_completion_logprobs_format(stack):
    body = complete(stack["url"], prompt="The sky is", max_tokens=3, logprobs=2,
                    temperature=0).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0


# -- prompts ----------------------------------------------------------------------------


def test_token_id_prompts_bypass_the_tokenizer_pool(stack):
    before = pool_jobs(stack["pool"].address)
    body = complete(stack["url"], prompt=[15496, 995, 11], max_tokens=4, temperature=0,
                    return_token_ids=True).json()
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["prompt_token_ids"] == [15496, 995, 11]
    batch = complete(stack["url"], prompt=[[15496], [995, 11]], max_tokens=2).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert pool_jobs(stack["pool"].address) == before
    complete(stack["url"], prompt="Hello world, this", max_tokens=1)
    assert pool_jobs(stack["pool"].address) == before + 1
    # Token ids and the text they encode give the same completion.
    text_body = complete(stack["url"], prompt="Hello world,", max_tokens=4, temperature=0,
                         return_token_ids=True).json()
    assert text_body["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]


def test_the_frontend_loads_no_torch(stack):
    """It only decodes, with tokenizer.json's Rust tokenizer: transformers, and torch
    with it, would cost each frontend 3 s to start and 300 MB."""
    maps = open(f"/proc/{stack['frontend'].proc.pid}/maps").read()
    assert "libtorch" not in maps and "libgomp" not in maps


def test_a_starting_frontend_opens_its_port_once_it_can_serve(tmp_path, tiny_llama_dir):
    """Started beside a running engine (a rolling update), a frontend's first request
    is served, not refused for the time its handshakes take (here the engine answers
    each Hello 2 s late)."""
    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock",
                              env={"ROSESERVE_FAULT_HELLO_DELAY_S": "2"})
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/tok.sock", workers=1)
    procs = [engine, pool]
    try:
        ping(EngineClient, engine.address)  # the engine is up (its Ready 2 s late)
        front = processes.frontend(tiny_llama_dir, engine.address, pool.address,
                                   "--served-model-name", "tiny")
        procs.append(front)
        port = int(front.url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while True:  # the first moment the port accepts
            assert front.proc.poll() is None and time.monotonic() < deadline, front.stop()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.01)
        r = httpx.post(front.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": [11, 12, 13], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        for p in reversed(procs):
            p.stop()


def test_stop_string_spanning_tokens_ends_the_request(stack):
    base = complete(stack["url"], prompt="Story:", max_tokens=20, temperature=0,
                    return_token_ids=True).json()["choices"][0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack["engine"].args[2])
    pieces = [tok.decode([t]) for t in base["token_ids"]]
    k = next(i for i in range(3, 19) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]  # spans the boundary between tokens k, k+1
    text_before = "".join(pieces[:k + 1])
    expected = text_before[:text_before.find(stop)] if stop in text_before else (
        text_before[:-2])
    for stream in (False, True):
        r = complete(stack["url"], prompt="Story:", max_tokens=20, temperature=0, stop=[stop],
                     stream=stream, return_token_ids=True)
        if stream:
            events = [e for e in sse_events(r) if e != "[DONE]"]
            text = "".join(e["choices"][0]["text"] for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            choice = r.json()["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        assert text == expected and stop not in text
        assert finish == "stop"
    stats = wait_engine_idle(stack["engine"].address)
    assert stats.num_running == 0 and stats.num_blocks_used == 0


def test_priority_reaches_the_engine_with_every_choice():
    from frontend.openai_protocol import ChatCompletionRequest, CompletionRequest

    body = CompletionRequest(model="m", prompt="x", priority=-3)
    assert body.sampling_params(4, None, 1).priority == -3
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert chat.sampling_params(4, None, 0).priority == 0


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 is taken only with echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "no fill-in-the-middle tokens"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of", "must be at least n"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias", "must be token ids"),
    ({"prompt": "x", "logit_bias": {"70000": 1}}, "logit_bias", "70000 outside the vocabulary"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
    ({"prompt": "x", "allowed_token_ids": [70000]}, "allowed_token_ids", "outside the vocabulary"),
    ({"prompt": "x", "bad_words": [""]}, "bad_words", "empty"),
    ({"prompt": "x", "guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"prompt": "x", "guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    ({"prompt": "x", "guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice", "non-empty list"),
    ({"prompt": "x", "guided_grammar": "root ::= (("}, "guided_grammar", "not a valid grammar"),
    ({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "give at most one"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "needs a json_schema"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"prompt": "x", "bogus": 1}, "bogus", "'bogus' is not a supported parameter"),
    ({"max_tokens": 3}, "prompt", "'prompt' is required"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens",
     "maximum context length is 512 tokens, but the prompt has 1 tokens and max_tokens is 600"),
    ({"prompt": [], "max_tokens": 2}, "prompt", "empty"),
    ({"prompt": [1, 70000], "max_tokens": 2}, "prompt", "70000 outside the vocabulary"),
    ({"prompt": "x", "stop_token_ids": [-4]}, "stop_token_ids", "outside the vocabulary"),
    ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
    # A field of several forms: the form the value went furthest into, else the forms.
    ({"prompt": [1.5]}, "prompt", "prompt: must be a string, a list of strings, a list of "
                                  "token ids (integers) or a list of lists of token ids"),
    ({"prompt": [[1], "a"]}, "prompt", "must be a string, a list of strings"),
    ({"prompt": [1, 2**40]}, "prompt.1", "less than or equal to 2147483647"),
    ({"prompt": "x", "stop": 5}, "stop", "stop: must be a string or a list of strings"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop.1", "valid string"),
    ({"prompt": "x", "guided_json": 5}, "guided_json", "must be a JSON schema"),
])
def test_invalid_requests_get_400_shaped_like_openai(stack, body, param, fragment):
    for stream in (False, True):
        r = complete(stack["url"], **{**body, "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert fragment in error["message"]


def test_the_default_max_tokens_fits_the_room_a_long_prompt_leaves(stack):
    # Completions default to 16 tokens; a client that did not ask for 16 gets what
    # the context holds (here 2 of 512) rather than a 400. One that asked gets the 400.
    prompt = [5] * 510
    for stream in (False, True):
        r = complete(stack["url"], prompt=prompt, stream=stream, ignore_eos=True,
                     stream_options={"include_usage": True} if stream else None)
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r)
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1]
            usage = events[-2]["usage"]
        else:
            finish, usage = r.json()["choices"][0]["finish_reason"], r.json()["usage"]
        assert finish == "length"
        assert usage["prompt_tokens"] == 510 and usage["completion_tokens"] == 2
    r = complete(stack["url"], prompt=[5] * 600, truncate_prompt_tokens=500, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    r = complete(stack["url"], prompt=prompt, max_tokens=16)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = complete(stack["url"], prompt=[5] * 512)
    assert r.status_code == 400 and "leaving no room" in r.json()["error"]["message"]
    # A chat's prompt is its messages (OpenAI's param).
    r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "word " * 600}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "messages" and "leaving no room" in error["message"]


def test_an_unknown_model_is_404_like_openai(stack):
    for stream in (False, True):
        r = complete(stack["url"], prompt="x", model="gpt-4", stream=stream)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert error["type"] == "not_found_error" and "'gpt-4' does not exist" in error["message"]
    r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
        "model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_malformed_json_and_chat_errors(stack):
    r = httpx.post(stack["url"] + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
        "model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
    r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
        "model": "tiny-llama", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.0.content"
    assert "part 1 has type 'image_url'" in error["message"] and "text only" in error["message"]
    for content, param, fragment in (
            (5, "messages.0.content", "must be a string or a list of text parts"),
            ([{"type": "text"}], "messages.0.content.0.text", "is required")):
        r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": content}]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and fragment in error["message"]
    for choice, param, fragment in (
            ("x", "tool_choice", "'none', 'auto', 'required' or a function to call by name"),
            ({"type": "function"}, "tool_choice.function", "is required")):
        r = httpx.post(stack["url"] + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "x"}], "tool_choice": choice})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and fragment in error["message"]
    r = httpx.get(stack["url"] + "/v1/nowhere", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_api_key_is_required_except_for_health_and_metrics(strict):
    url = strict["url"]
    r = complete(url, prompt="x", max_tokens=1)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = complete(url, headers={"Authorization": "Bearer wrong"}, prompt="x", max_tokens=1)
    assert r.status_code == 401
    assert complete(url, headers=strict["auth"], prompt="x", max_tokens=1).status_code == 200
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/metrics", timeout=30).status_code == 200


def test_browsers_of_allowed_origins_only_and_their_preflight_needs_no_key(stack, strict):
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(strict["url"] + "/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = complete(strict["url"], headers={**strict["auth"], "Origin": "https://ui.example"},
                 prompt="x", max_tokens=1)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    # Without the key the page is refused as any client is, and can read why.
    r = complete(strict["url"], headers={"Origin": "https://ui.example"}, prompt="x")
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ui.example"
    # Another origin, or a frontend that allows none: no CORS headers, so the browser
    # keeps the answer from the page.
    r = httpx.options(strict["url"] + "/v1/completions",
                      headers={**preflight, "Origin": "https://evil.example"}, timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.options(stack["url"] + "/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = complete(stack["url"], headers={"Origin": "https://ui.example"}, prompt="x", max_tokens=1)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_body_over_the_limit_gets_413(strict):
    r = complete(strict["url"], headers=strict["auth"], prompt="x" * 5000, max_tokens=1)
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]


def test_admission_limit_gives_429_and_a_queued_disconnect_is_aborted(strict):
    url, auth = strict["url"], strict["auth"]
    long_body = {"model": "tiny-llama", "prompt": "a", "max_tokens": 300, "stream": True}
    with httpx.Client(timeout=60, headers=auth) as client:
        with client.stream("POST", url + "/v1/completions", json=long_body) as running:
            lines = running.iter_lines()  # kept: dropping the iterator closes the stream
            next(lines)  # decoding: the engine's only slot is taken
            queued = _open_raw_request(url, {**long_body, "prompt": "b"}, auth)
            deadline = time.monotonic() + 5  # admitted, then waiting for the slot
            while engine_stats(strict["engine"].address).num_waiting != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            r = client.post(url + "/v1/completions",
                            json={"model": "tiny-llama", "prompt": "c", "max_tokens": 1})
            assert r.status_code == 429
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            queued.close()  # the queued client goes away
            deadline = time.monotonic() + 3
            while engine_stats(strict["engine"].address).num_waiting:
                assert time.monotonic() < deadline, "the queued request was not aborted"
                time.sleep(0.05)
            assert engine_stats(strict["engine"].address).num_running == 1  # "a" still runs
    stats = wait_engine_idle(strict["engine"].address)
    assert stats.num_running == 0 and stats.num_blocks_used == 0
    # Every admission slot came back: the next request is admitted, not refused.
    r = complete(url, headers=auth, prompt="next", max_tokens=2)
    assert r.status_code == 200


def _open_raw_request(url: str, body: dict, headers: dict) -> socket.socket:
    """An HTTP request sent on a raw socket, left unread, to be dropped later."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    sock.sendall(head.encode() + payload)
    return sock


def test_disconnect_mid_stream_aborts_and_frees_blocks(stack):
    before = engine_stats(stack["engine"].address).num_generated_tokens
    with httpx.stream("POST", stack["url"] + "/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "go", "max_tokens": 400, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    stats = wait_engine_idle(stack["engine"].address)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_blocks_used == 0
    # Stopped well short of max_tokens: the abort, not the end of generation, freed it.
    assert stats.num_generated_tokens - before < 100, stats.num_generated_tokens - before


def wait_until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_disconnect_while_tokenizing_never_reaches_the_engine(stack):
    """Each stage is observed, not waited for: the job is in the tokenizer pool when
    the client leaves; the frontend lets go of it; the pool finishes it; and a request
    sent afterwards is the next thing the engine sees (the frontend's frames to the
    engine arrive in order, so a late submission of the first would come before it)."""
    pool = stack["pool"].address
    before = engine_stats(stack["engine"].address).prefix_cache_query_tokens
    sock = _open_raw_request(stack["url"], {"model": "tiny-llama", "prompt": SLOW + " text",
                                            "max_tokens": 50}, {})
    wait_until(lambda: ping(TokenizerClient, pool).num_pending >= 1, "the job in the pool")
    sock.close()
    wait_until(lambda: parse_metric(scrape(stack["url"]), "roseserve_admitted_requests") == 0,
               "the frontend to release the job")
    wait_until(lambda: ping(TokenizerClient, pool).num_pending == 0, "the slow tokenization")
    probe = httpx.post(stack["url"] + "/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": "probe", "max_tokens": 1})
    assert probe.status_code == 200
    stats = wait_engine_idle(stack["engine"].address)
    # Only the probe's prompt was ever looked up: nothing of the first was submitted.
    assert stats.prefix_cache_query_tokens == before + probe.json()["usage"]["prompt_tokens"]
    assert stats.num_running == 0


def test_metrics_and_health(stack):
    assert httpx.get(stack["url"] + "/health", timeout=30).json()["status"] == "ok"
    assert complete(stack["url"], prompt="count me", max_tokens=2).status_code == 200
    text = httpx.get(stack["url"] + "/metrics", timeout=30).text
    # vLLM's names and labels (engine 0 of model tiny-llama), so its dashboards work.
    labels = '{engine="0",model_name="tiny-llama"}'
    for name in ("vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket",
                 "vllm:request_prefill_time_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert f'{name}{{engine="0",le="+Inf",model_name="tiny-llama"}}' in text, name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name + labels in text, name
    assert ('vllm:request_success_total{engine="0",finished_reason="length",'
            'model_name="tiny-llama"}') in text
    assert 'roseserve_tokenize_time_seconds_count{model_name="tiny-llama"}' in text
    assert "roseserve_tokenizer_queue" in text

    def value(text: str, name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + labels))
        return float(line.rsplit(" ", 1)[1])

    names = ("vllm:request_params_n_sum", "vllm:request_params_n_count",
             "vllm:request_params_max_tokens_sum", "vllm:request_decode_time_seconds_count",
             "vllm:request_inference_time_seconds_count")
    before = [value(text, n) for n in names]
    r = complete(stack["url"], prompt="count me", max_tokens=3, n=2, ignore_eos=True)
    assert r.status_code == 200
    text = httpx.get(stack["url"] + "/metrics", timeout=30).text
    assert [value(text, n) - b for n, b in zip(names, before)] == [2, 1, 3, 2, 2]


def test_engine_down_gives_503_and_unhealthy(strict):
    strict["engine"].proc.kill()
    strict["engine"].proc.wait()
    time.sleep(1.0)
    r = complete(strict["url"], headers=strict["auth"], prompt="x", max_tokens=1)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(strict["url"] + "/health", timeout=30).status_code == 503


def test_one_frontend_routes_to_several_engines_and_survives_losing_one(
        tmp_path, tiny_llama_dir):
    engines = [processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/e{i}.sock") for i in range(2)]
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/tok.sock", workers=1)
    front = processes.frontend(tiny_llama_dir, engines[0].address, pool.address,
                               "--engine", engines[1].address, "--served-model-name", "tiny-llama")
    try:
        # both engines joined: the frontend serves as soon as one has
        processes.wait_healthy(front, engines=tuple(e.address for e in engines))

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*[client.post(front.url + "/v1/completions", json={
                    "model": "tiny-llama", "prompt": f"p{i}", "max_tokens": 40,
                    "ignore_eos": True}) for i in range(8)])

        assert all(r.status_code == 200 for r in asyncio.run(burst()))
        served = [engine_stats(e.address).num_generated_tokens for e in engines]
        assert all(n > 0 for n in served) and sum(served) == 8 * 40  # both took a share
        engines[0].proc.kill()
        engines[0].proc.wait()
        time.sleep(1.0)
        health = httpx.get(front.url + "/health", timeout=30)
        assert health.status_code == 200  # one engine still serves
        assert health.json()["checks"][f"engine {engines[0].address}"] != "ok"
        r = complete(front.url, prompt="still here", max_tokens=3)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # Without the tokenizer pool: unhealthy, text prompts get 503, token ids still run.
        pool.proc.kill()
        pool.proc.wait()
        time.sleep(1.0)
        assert httpx.get(front.url + "/health", timeout=30).status_code == 503
        r = complete(front.url, prompt="needs tokenizing", max_tokens=2)
        assert r.status_code == 503 and "tokenizer pool" in r.json()["error"]["message"]
        assert complete(front.url, prompt=[15496, 995], max_tokens=2).status_code == 200
    finally:
        for p in (front, pool, *engines):
            p.stop()
