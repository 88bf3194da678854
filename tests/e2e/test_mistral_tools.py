"""Mistral's tool calls end to end: a tiny model whose tokenizer has Mistral's special
[TOOL_CALLS] and [ARGS] tokens and a template of its kind (tests/conftest.py), real
processes. The model's reply is forced by a grammar that names the special tokens by
id, as a model trained for Mistral's format would write it."""

from __future__ import annotations

import httpx
import pytest

import processes
from conftest import ARGS, TOOL_CALLS
from frontend_stacks import chat_after_calls, forced_calls
from helpers import WEATHER

QUESTION = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
# Replies as Mistral's v3 and v11 tokenizers' models write calls.
REPLIES = {
    "v3": f'start: "Sure." <[{TOOL_CALLS}]> " [" CALL ", " CALL2 "]"\n'
          'CALL: "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}"\n'
          'CALL2: "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Oslo\\"}}"\n',
    "v11": f'start: "Sure." <[{TOOL_CALLS}]> "get_weather" <[{ARGS}]> "{{\\"city\\": \\"Paris\\"}}" '
           f'<[{TOOL_CALLS}]> "get_weather" <[{ARGS}]> "{{\\"city\\": \\"Oslo\\"}}"\n',
}


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_mistral_dir):
    run = tmp_path_factory.mktemp("mistral")
    with processes.local_stack(tiny_mistral_dir, run, "--served-model-name", "m") as front:
        yield front.url


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": "m", "messages": QUESTION, "max_tokens": 80,
                            "temperature": 0, **body})


@pytest.mark.parametrize("version", REPLIES)
def test_mistral_calls_come_back_as_tool_calls(url, version):
    message, streamed = forced_calls(
        url, {"model": "m", "messages": QUESTION, "tools": [WEATHER], "max_tokens": 80,
              "temperature": 0, "guided_grammar": REPLIES[version]},
        "Sure.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})])
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message["tool_calls"])
    assert [c["function"]["name"] for c in streamed if "id" in c] == ["get_weather"] * 2
    # The calls given back, with their results, pass the template's check of their ids.
    r = chat_after_calls(url, QUESTION, message, [WEATHER])
    assert r.status_code == 200, r.text


def test_a_reply_without_calls_is_text_and_keeps_no_special_token(url):
    """Text is text; only a request that may make calls keeps special tokens."""
    grammar = f'start: "Hello" <[{ARGS}]> " there"\n'
    for tools in ({"tools": [WEATHER]}, {"tool_choice": "none", "tools": [WEATHER]}, {}):
        r = chat(url, guided_grammar=grammar, **tools)
        message = r.json()["choices"][0]["message"]
        assert message.get("tool_calls") in (None, [])
        auto = tools.get("tool_choice", "auto" if tools else None) == "auto"
        assert message["content"] == ("Hello[ARGS] there" if auto else "Hello there")
