"""Granite 3's tool calls end to end: a tiny model whose tokenizer has Granite's special
<|tool_call|> token and a template of its kind (tests/conftest.py), real processes. The
model's reply is forced by a grammar that names the special token by id, as a model
trained for Granite's format would write it: the tag, then the calls' JSON list."""

from __future__ import annotations

import httpx
import pytest

import processes
from conftest import GRANITE_CALL
from frontend_stacks import chat_after_calls, forced_calls
from helpers import WEATHER

QUESTION = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
REPLY = (f'start: "Sure." <[{GRANITE_CALL}]> "[" CALL ", " CALL2 "]"\n'
         'CALL: "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": '
         '\\"Paris\\"}}"\n'
         'CALL2: "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": '
         '\\"Oslo\\"}}"\n')


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_granite_tools_dir):
    run = tmp_path_factory.mktemp("granite")
    with processes.local_stack(tiny_granite_tools_dir, run, "--served-model-name", "m") as front:
        yield front.url


def body(**extra) -> dict:
    return {"model": "m", "messages": QUESTION, "max_tokens": 80, "temperature": 0, **extra}


def test_granite_calls_come_back_as_tool_calls(url):
    message, _ = forced_calls(
        url, body(tools=[WEATHER], guided_grammar=REPLY),
        "Sure.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})])
    # The calls given back render through the template, after its tag.
    r = chat_after_calls(url, QUESTION, message, [WEATHER])
    assert r.status_code == 200, r.text


def test_a_granite_reply_without_calls_is_text(url):
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json=body(tools=[WEATHER], guided_grammar='start: "Hello there"\n'))
    message = r.json()["choices"][0]["message"]
    assert message.get("tool_calls") in (None, []) and message["content"] == "Hello there"
