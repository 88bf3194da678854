"""Llama 3's tool calls end to end: a tiny model whose tokenizer has Llama 3's special
<|python_tag|> token and a template of its kind (tests/conftest.py), real processes.
The model's reply is forced by a grammar, as a model trained for the format would
write it; the unit tests of the reader are in test_tools.py."""

from __future__ import annotations

import json

import httpx
import pytest

import processes
from conftest import PYTHON_TAG
from frontend_stacks import chat_after_calls, sse_events
from helpers import WEATHER

QUESTION = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
# Two calls, after <|python_tag|> (Llama 3.1's built-in tools' way) and without it.
CALLS = ('"{\\"name\\": \\"get_weather\\", \\"parameters\\": {\\"city\\": \\"Paris\\"}}; '
         '{\\"name\\": \\"get_time\\", \\"parameters\\": {}}"')
REPLIES = {"python_tag": f"start: <[{PYTHON_TAG}]> {CALLS}\n", "plain": f"start: {CALLS}\n"}


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_llama3_dir):
    run = tmp_path_factory.mktemp("llama3")
    with processes.local_stack(tiny_llama3_dir, run, "--served-model-name", "m") as front:
        yield front.url


def body(grammar: str, **kw) -> dict:
    return {"model": "m", "messages": QUESTION, "tools": [WEATHER, TIME], "max_tokens": 80,
            "temperature": 0, "guided_grammar": grammar, **kw}


def streamed(url: str, grammar: str) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json=body(grammar, stream=True)) as s:
        assert s.status_code == 200
        return sse_events(s)


@pytest.mark.parametrize("reply", REPLIES)
def test_llama3_calls_come_back_as_tool_calls_and_stream(url, reply):
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=body(REPLIES[reply]))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    calls = message["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    # Streamed: each call as soon as its name is whole, then its arguments in pieces.
    events = streamed(url, REPLIES[reply])
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    named = [c for c in pieces if "id" in c]
    assert [(c["index"], c["function"]["name"]) for c in named] == [
        (0, "get_weather"), (1, "get_time")]
    first_args = [c["function"].get("arguments", "") for c in pieces if c["index"] == 0]
    assert len([a for a in first_args if a]) > 2  # grew with the text, not at the end
    assert ["".join(c["function"].get("arguments", "") for c in pieces if c["index"] == i)
            for i in (0, 1)] == [c["function"]["arguments"] for c in calls]
    assert [e for e in events[:-1] if e["choices"]][-1]["choices"][0]["finish_reason"] \
        == "tool_calls"
    # The calls given back, with a result, render through the template.
    r = chat_after_calls(url, QUESTION, message, [WEATHER])
    assert r.status_code == 200, r.text


def test_a_reply_whose_name_is_no_tools_is_text(url):
    text = '{"name": "other", "parameters": {}} and words'
    grammar = "start: " + json.dumps(text) + "\n"
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=body(grammar))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == text and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    events = streamed(url, grammar)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == text
    assert not any(d.get("tool_calls") for d in deltas)
