"""Hostile HTTP against the real stack under ``roseserve serve``: every malformed,
mistyped or out-of-range body gets an OpenAI-shaped 4xx, never a 500 or a dropped
connection, and every value at its bound is served."""

from __future__ import annotations

import json

import httpx
import pytest

import processes
from processes import metric, serves


@pytest.fixture
def stack(tiny_llama_dir, tmp_path):
    s = processes.Serve(tiny_llama_dir, tmp_path / "serve.log")
    s.wait_ready()
    yield s
    assert s.stop() == 0, s.log()


BIG = 10**30


def _cmpl(**kw) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2, **kw}).encode()


def _chat(**kw) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 2, **kw}).encode()


def _resp(**kw) -> bytes:
    return json.dumps({"model": "tiny", "input": "Hi", "max_output_tokens": 2, **kw}).encode()


C, CHAT, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"
# (name, path, body): each must get an OpenAI-shaped 4xx.
FUZZ = [
    # malformed JSON
    ("empty body", C, b""), ("truncated", C, b'{"model": "tiny", "prompt": "Hi"'),
    ("trailing garbage", C, _cmpl() + b" x"), ("not an object", C, b"[1, 2]"),
    ("null", C, b"null"), ("a string", CHAT, b'"hello"'), ("missing value", C, b'{"model": }'),
    ("single quotes", C, b"{'model': 'tiny'}"), ("duplicate-ish junk", C, b"{,}"),
    # wrong types
    ("prompt number", C, _cmpl(prompt=5)), ("prompt object", C, _cmpl(prompt={"a": 1})),
    ("prompt mixed list", C, _cmpl(prompt=[1, "a"])), ("prompt nested mix", C, _cmpl(prompt=[[1], "a"])),
    ("prompt float ids", C, _cmpl(prompt=[1.5, 2.5])), ("prompt bool ids", C, _cmpl(prompt=[True])),
    ("max_tokens string", C, _cmpl(max_tokens="10")), ("max_tokens float", C, _cmpl(max_tokens=1.5)),
    ("temperature string", C, _cmpl(temperature="hot")), ("n list", C, _cmpl(n=[1])),
    ("stream string", C, _cmpl(stream="yes")), ("stop number", C, _cmpl(stop=5)),
    ("stop list of numbers", C, _cmpl(stop=[1, 2])), ("stop empty string", C, _cmpl(stop="")),
    ("stop_token_ids strings", C, _cmpl(stop_token_ids=["a"])),
    ("model number", C, _cmpl(model=5)),
    ("messages string", CHAT, _chat(messages="hi")), ("messages empty", CHAT, _chat(messages=[])),
    ("message empty object", CHAT, _chat(messages=[{}])),
    ("message bad role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}])),
    ("message content number", CHAT, _chat(messages=[{"role": "user", "content": 5}])),
    ("message bad part", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image"}]}])),
    ("message without content", CHAT, _chat(messages=[{"role": "user"}])),
    ("message content null", CHAT, _chat(messages=[{"role": "system", "content": None}])),
    ("assistant with no content or calls", CHAT, _chat(messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}])),
    ("tool_calls on a user message", CHAT, _chat(messages=[{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])),
    ("tool message without tool_call_id", CHAT, _chat(messages=[
        {"role": "user", "content": "Hi"}, {"role": "tool", "content": "18 C"}])),
    ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=2)),
    ("unknown field", C, _cmpl(temprature=0.5)), ("stream_options junk", C, _cmpl(stream_options=5)),
    # NaN, Infinity, numbers too big for anything
    ("NaN temperature", C, b'{"model":"tiny","prompt":"Hi","temperature":NaN}'),
    ("Infinity top_p", C, b'{"model":"tiny","prompt":"Hi","top_p":Infinity}'),
    ("-Infinity penalty", C, b'{"model":"tiny","prompt":"Hi","presence_penalty":-Infinity}'),
    ("1e400 temperature", C, b'{"model":"tiny","prompt":"Hi","temperature":1e400}'),
    ("huge max_tokens", C, _cmpl(max_tokens=BIG)), ("huge n", C, _cmpl(n=BIG)),
    ("huge seed", C, _cmpl(seed=BIG)), ("negative huge seed", C, _cmpl(seed=-BIG)),
    ("huge top_k", C, _cmpl(top_k=BIG)), ("huge min_tokens", C, _cmpl(min_tokens=BIG)),
    ("huge truncate", C, _cmpl(truncate_prompt_tokens=BIG)), ("huge logprobs", C, _cmpl(logprobs=BIG)),
    ("huge token id", C, _cmpl(prompt=[BIG])), ("negative token id", C, _cmpl(prompt=[-1])),
    ("huge stop token id", C, _cmpl(stop_token_ids=[BIG])),
    ("huge max_completion_tokens", CHAT, _chat(max_completion_tokens=BIG)),
    ("huge top_logprobs", CHAT, _chat(logprobs=True, top_logprobs=BIG)),
    ("1e30 float max_tokens", C, b'{"model":"tiny","prompt":"Hi","max_tokens":1e30}'),
    # deep nesting, huge strings
    ("deep array", C, b"[" * 100_000 + b"]" * 100_000),
    ("deep object", C, b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    ("deep prompt", C, b'{"model":"tiny","prompt":' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("body over the limit", C, _cmpl(prompt="x" * (9 << 20))),
    ("huge model name", C, _cmpl(model="m" * (1 << 20))),
    ("prompt past the context", C, _cmpl(prompt="hello " * 100_000)),
    ("too many prompts", C, _cmpl(prompt=[[1]] * 300)),
    ("too many choices", C, _cmpl(prompt=[[1]] * 20, n=64)),
    # invalid UTF-8, lone surrogates, control characters
    ("invalid utf-8", C, b'{"model":"tiny","prompt":"\xff\xfe\xfa"}'),
    ("truncated utf-8", C, b'{"model":"tiny","prompt":"\xe2\x82"}'),
    ("lone high surrogate", C, b'{"model":"tiny","prompt":"\\ud800"}'),
    ("lone low surrogate", CHAT, b'{"model":"tiny","messages":[{"role":"user","content":"\\udc00"}]}'),
    ("surrogate in stop", C, b'{"model":"tiny","prompt":"Hi","stop":"\\ud83d"}'),
    ("surrogate in model", C, b'{"model":"\\ud800","prompt":"Hi"}'),
    ("raw control char", C, b'{"model":"tiny","prompt":"a\x01b"}'),
    # every parameter just beyond its bounds
    ("temperature > 2", C, _cmpl(temperature=2.0001)), ("temperature < 0", C, _cmpl(temperature=-0.1)),
    ("top_p 0", C, _cmpl(top_p=0)), ("top_p > 1", C, _cmpl(top_p=1.01)),
    ("n 0", C, _cmpl(n=0)), ("n 65", C, _cmpl(n=65)),
    ("presence_penalty > 2", C, _cmpl(presence_penalty=2.01)),
    ("frequency_penalty < -2", C, _cmpl(frequency_penalty=-2.01)),
    ("top_k -2", C, _cmpl(top_k=-2)), ("min_p > 1", C, _cmpl(min_p=1.5)), ("min_p < 0", C, _cmpl(min_p=-0.1)),
    ("repetition_penalty 0", C, _cmpl(repetition_penalty=0)),
    ("repetition_penalty 1000", C, _cmpl(repetition_penalty=1000)),
    ("max_tokens 0", C, _cmpl(max_tokens=0)), ("max_tokens past context", C, _cmpl(max_tokens=512)),
    ("min_tokens negative", C, _cmpl(min_tokens=-1)),
    ("min_tokens > max_tokens", C, _cmpl(min_tokens=5, max_tokens=2)),
    ("logprobs 21", C, _cmpl(logprobs=21)), ("logprobs -1", C, _cmpl(logprobs=-1)),
    ("top_logprobs 21", CHAT, _chat(logprobs=True, top_logprobs=21)),
    ("truncate 0", C, _cmpl(truncate_prompt_tokens=0)),
    ("token id = vocab", C, _cmpl(prompt=[50257])), ("stop token id = vocab", C, _cmpl(stop_token_ids=[50257])),
    ("seed 2^64", C, _cmpl(seed=2**64)), ("seed below -2^63", C, _cmpl(seed=-(2**63) - 1)),
    ("priority 2^31", C, _cmpl(priority=2**31)), ("priority a string", C, _cmpl(priority="high")),
    ("empty prompt", C, _cmpl(prompt="")), ("empty token list", C, _cmpl(prompt=[])),
    ("unknown model", C, _cmpl(model="gpt-4")),
    ("best_of < n", C, _cmpl(best_of=1, n=2)), ("logit_bias 1000", C, _cmpl(logit_bias={"1": 1000})),
    ("logit_bias NaN-ish key", C, _cmpl(logit_bias={"1e3": 5})),
    ("bad schema", CHAT, _chat(response_format={"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": {"type": 5}}})),
    ("bad regex", C, _cmpl(guided_regex="(")), ("bad grammar", C, _cmpl(guided_grammar="root ::= (")),
    ("tool_choice auto without a template", CHAT, _chat(tools=[
        {"type": "function", "function": {"name": "f"}}])),
    ("tool_choice names an unknown tool", CHAT, _chat(tools=[
        {"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}})),
    ("tool_choice required without tools", CHAT, _chat(tool_choice="required")),
    ("store true", CHAT, _chat(store=True)), ("service_tier flex", CHAT, _chat(service_tier="flex")),
    ("audio out", CHAT, _chat(modalities=["text", "audio"])),
    ("metadata of 17 pairs", CHAT, _chat(metadata={str(i): "v" for i in range(17)})),
    ("metadata not strings", CHAT, _chat(metadata={"k": 5})),
    ("response input a number", RESP, _resp(input=5)), ("response input null", RESP, _resp(input=None)),
    ("response of an image", RESP, _resp(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}])),
    ("response item of a bad role", RESP, _resp(input=[{"role": "tool", "content": "x"}])),
    ("response stored", RESP, _resp(store=True)),
    ("response continuing another", RESP, _resp(previous_response_id="resp_1")),
    ("response past the context", RESP, _resp(max_output_tokens=BIG)),
    ("response in the background", RESP, _resp(background=True)),
    ("template kwargs naming the template", CHAT, _chat(
        chat_template_kwargs={"chat_template": "{{ raise_exception('x') }}"})),
    ("template kwargs of 33 names", CHAT, _chat(chat_template_kwargs={f"k{i}": 1 for i in range(33)})),
    ("template kwargs a list", CHAT, _chat(chat_template_kwargs=[1])),
    ("thinking on a user message", CHAT, _chat(messages=[
        {"role": "user", "content": "Hi", "reasoning_content": "x"}])),
    ("response reasoning encrypted", RESP, _resp(input=[
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}])),
    # vLLM's and OpenAI's extras, each wrong
    ("cache_salt empty", C, _cmpl(cache_salt="")), ("cache_salt a number", CHAT, _chat(cache_salt=7)),
    ("cache_salt of 2 KB", C, _cmpl(cache_salt="s" * 2048)),
    ("structured_outputs of two", C, _cmpl(structured_outputs={"regex": "a", "choice": ["b"]})),
    ("structured_outputs of none", CHAT, _chat(structured_outputs={})),
    ("structured_outputs structural_tag", C, _cmpl(structured_outputs={"structural_tag": "{}"})),
    ("structured_outputs json a number", C, _cmpl(structured_outputs={"json": 5})),
    ("prediction of another type", CHAT, _chat(prediction={"type": "x", "content": "y"})),
    ("prediction content a number", CHAT, _chat(prediction={"type": "content", "content": 5})),
    ("suffix without fill-in-the-middle tokens", C, _cmpl(suffix="x")),
    ("suffix a number", C, _cmpl(suffix=5)),
    ("return_tokens_as_token_ids a string", C, _cmpl(return_tokens_as_token_ids="yes")),
    ("add_special_tokens a string", CHAT, _chat(add_special_tokens="no")),
]
# At the bounds: each must be served (200).
AT_BOUNDS = [
    ("model missing (the first served)", C, b'{"prompt": "Hi", "max_tokens": 2}'),
    ("temperature 0", C, _cmpl(temperature=0)), ("temperature 2", C, _cmpl(temperature=2)),
    ("temperature 1e-39", C, _cmpl(temperature=1e-39)), ("top_p 1", C, _cmpl(top_p=1)),
    ("top_p tiny", C, _cmpl(top_p=1e-9)), ("n 64", C, _cmpl(n=64, max_tokens=1)),
    ("penalties at 2", C, _cmpl(presence_penalty=2, frequency_penalty=-2)),
    ("top_k 1", C, _cmpl(top_k=1)), ("top_k huge but sane", C, _cmpl(top_k=2**31 - 1)),
    ("top_k -1 (vLLM: every token)", C, _cmpl(top_k=-1)), ("top_k 0", C, _cmpl(top_k=0)),
    ("min_p 1", C, _cmpl(min_p=1)), ("repetition_penalty 0.01", C, _cmpl(repetition_penalty=0.01)),
    ("repetition_penalty 100", C, _cmpl(repetition_penalty=100)),
    ("max_tokens to the context", C, _cmpl(prompt=[1], max_tokens=511)),
    ("logprobs 20", C, _cmpl(logprobs=20)), ("top_logprobs 20", CHAT, _chat(logprobs=True, top_logprobs=20)),
    ("seed max", C, _cmpl(seed=2**64 - 1, n=2)), ("seed min", C, _cmpl(seed=-(2**63))),
    ("priority at both ends", C, _cmpl(priority=2**31 - 1, n=2)),
    ("priority min", CHAT, _chat(priority=-(2**31 - 1))),
    ("token id vocab-1", C, _cmpl(prompt=[50256])), ("truncate 1", C, _cmpl(truncate_prompt_tokens=1)),
    ("unicode prompt", C, _cmpl(prompt="héllo 🌹 世界 \u0000")),
    ("surrogate pair", C, b'{"model":"tiny","prompt":"\\ud83c\\udf39","max_tokens":2}'),
    ("logit_bias at +-100", C, _cmpl(logit_bias={"1": 100, "2": -100})),
    ("a grammar of only the empty string", C, _cmpl(guided_grammar='root ::= ""')),
    ("a response", RESP, _resp(instructions="Be brief", temperature=0, store=False)),
    ("OpenAI's no-op fields", CHAT, _chat(store=False, metadata={"k": "v"}, service_tier="default",
                                          modalities=["text"], prompt_cache_key="k",
                                          safety_identifier="u")),
    ("template kwargs", CHAT, _chat(chat_template_kwargs={"enable_thinking": False, "x": {"y": [1]}})),
    ("earlier thinking", CHAT, _chat(messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning": "t"},
        {"role": "user", "content": "Hi"}])),
    ("a response after its reasoning item", RESP, _resp(input=[
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
        {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Hi"}])),
    ("vLLM's and OpenAI's extras", C, _cmpl(cache_salt="s" * 1024, add_special_tokens=False,
                                            return_tokens_as_token_ids=True, logprobs=1,
                                            structured_outputs={"regex": "[ab]+"},
                                            prediction={"type": "content", "content": "ab"})),
    ("chat's extras", CHAT, _chat(add_special_tokens=True, structured_outputs={
        "json_object": True, "disable_any_whitespace": True}, max_tokens=8)),
]


def test_hostile_http_gets_a_4xx_never_a_500(stack):
    statuses, wrong = {}, []
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for name, path, body in FUZZ:
            try:
                r = client.post(path, content=body,
                                headers={"Content-Type": "application/json"})
            except httpx.HTTPError as e:
                wrong.append((name, type(e).__name__, str(e)))
                continue
            statuses[name] = r.status_code
            if not 400 <= r.status_code < 500 or not r.json().get("error", {}).get("message"):
                wrong.append((name, r.status_code, r.text[:200]))
        for name, path, body in AT_BOUNDS:
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
            if r.status_code != 200:
                wrong.append((name, r.status_code, r.text[:200]))
    assert not wrong, "\n".join(map(str, wrong))
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for method, path, status in (("GET", C, 405), ("POST", "/v1/nothing", 404),
                                     ("GET", "/v1/models/x/../../etc", 404)):
            r = client.request(method, path)
            assert r.status_code == status and r.json()["error"]["message"], (path, r.text)
    assert metric(stack.url, "roseserve_rejected_requests", status="500") == 0
    assert stack.proc.poll() is None and serves(stack.url)
    assert "exited with code" not in stack.log(), stack.log()
    counts: dict[int, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    print(f"\nfuzz corpus: {len(FUZZ)} hostile bodies -> {dict(sorted(counts.items()))}, "
          f"{len(AT_BOUNDS)} at the bounds -> 200")
