"""A reasoning model served over the real processes and HTTP: its thinking in
reasoning_content, a grammar that waits for its end, thinking switched off by the
template; the parsers alone: tests/unit/test_reasoning.py."""

from __future__ import annotations

import json

import httpx
import pytest

import processes
from conftest import END_THINK
from frontend_stacks import sse_events


def test_a_frontend_whose_model_has_no_tags_stops_at_start(tmp_path, tiny_llama_dir):
    front = processes.frontend(tiny_llama_dir, f"ipc://{tmp_path}/e.sock",
                               f"ipc://{tmp_path}/t.sock", "--reasoning-parser", "deepseek_r1")
    try:
        front.proc.wait(timeout=60)
        assert front.proc.returncode != 0
        assert "reasoning parser deepseek_r1: the model's tokenizer has no <think> token" \
            in front.output()
    finally:
        front.stop()


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_reasoner_dir):
    run = tmp_path_factory.mktemp("reasoner")
    with processes.local_stack(tiny_reasoner_dir, run, "--served-model-name", "r",
                               "--reasoning-parser", "deepseek_r1") as front:
        yield front.url


QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": "r", **body}, timeout=60)


def reference(url: str, messages=QUESTION, max_tokens: int = 8, **template):
    """The reply's raw text and token ids: the rendered prompt's token ids through
    /v1/completions, which no parser touches."""
    ids = post(url, "/tokenize", messages=messages, **template).json()["tokens"]
    r = post(url, "/v1/completions", prompt=ids, max_tokens=max_tokens, temperature=0,
             ignore_eos=True, return_token_ids=True)
    choice = r.json()["choices"][0]
    return choice["text"], choice["token_ids"]


def expected(text: str, thinking: bool) -> tuple:
    """The split as the parser's rule states it, for a whole reply."""
    if thinking:
        head, tag, tail = text.partition("</think>")
        return head.lstrip() or None, (tail.lstrip() or None) if tag else None
    return None, text or None


def test_the_thinking_goes_to_reasoning_content(url):
    text, ids = reference(url)
    thinking, answer = expected(text, True)
    assert thinking  # the model's 8 tokens, shown as its thinking
    thought = ids.index(END_THINK) + 1 if END_THINK in ids else 8
    r = post(url, "/v1/chat/completions", messages=QUESTION, max_tokens=8, temperature=0,
             ignore_eos=True)
    assert r.status_code == 200
    body = r.json()
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thinking, answer)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    # Streamed: the same, in deltas.
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": "r", "messages": QUESTION, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking
    assert "".join(d.get("content", "") for d in deltas) == (answer or "")
    assert events[-2]["usage"] == body["usage"]
    # include_reasoning false: the thinking is not returned.
    r = post(url, "/v1/chat/completions", messages=QUESTION, max_tokens=8, temperature=0,
             ignore_eos=True, include_reasoning=False)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == answer


def test_a_grammar_waits_for_the_end_of_the_thinking(url):
    """</think> forced by logit_bias: the grammar, held back until it, then makes the
    answer one of the choices (without the wait the grammar would have masked the
    tag, and its answer would have been taken for thinking)."""
    for stream in (False, True):
        r = post(url, "/v1/chat/completions", messages=QUESTION, max_tokens=10,
                 temperature=0, logit_bias={str(END_THINK): 100},
                 guided_choice=["yes", "no"], stream=stream,
                 stream_options={"include_usage": True} if stream else None)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            assert not any("reasoning_content" in d for d in deltas)
            content = "".join(d.get("content", "") for d in deltas)
            usage = events[-1]["usage"]
        else:
            message = r.json()["choices"][0]["message"]
            assert message["reasoning_content"] is None
            content, usage = message["content"], r.json()["usage"]
        assert content in ("yes", "no")
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 1}


def test_thinking_switched_off_by_the_template(url):
    """chat_template_kwargs reach the template: enable_thinking false closes the
    thinking in the prompt, and the reply is all answer."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    text, _ = reference(url, **off)
    r = post(url, "/v1/chat/completions", messages=QUESTION, max_tokens=8, temperature=0,
             ignore_eos=True, **off)
    body = r.json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    for kwargs, error in (({"chat_template": "{{ 1 }}"}, "'chat_template' is set by the server"),
                          ({"no-name": 1}, "'no-name' is not a template variable name")):
        r = post(url, "/v1/chat/completions", messages=QUESTION, chat_template_kwargs=kwargs)
        assert r.status_code == 400 and error in r.json()["error"]["message"], r.text


def test_earlier_thinking_reaches_the_template(url):
    history = QUESTION + [{"role": "assistant", "content": "4.",
                           "reasoning_content": "two and two"},
                          {"role": "user", "content": "Sure?"}]
    r = post(url, "/tokenize", messages=history, return_token_strs=True)
    assert "<think>\ntwo and two\n</think>\n\n4." in "".join(r.json()["token_strs"])
    # vLLM's newer name for it too.
    history[1] = {"role": "assistant", "content": "4.", "reasoning": "two and two"}
    assert post(url, "/tokenize", messages=history).json()["tokens"] == r.json()["tokens"]
    r = post(url, "/v1/chat/completions", max_tokens=2, messages=[
        {"role": "user", "content": "hi", "reasoning_content": "x"}])
    assert r.status_code == 400
    assert "a message of role 'user' has reasoning" in r.json()["error"]["message"]


def test_a_response_thinks_in_a_reasoning_item(url):
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    chat = post(url, "/v1/chat/completions", messages=QUESTION, max_tokens=8,
                temperature=0, ignore_eos=True).json()
    thinking = chat["choices"][0]["message"]["reasoning_content"]
    answer = chat["choices"][0]["message"]["content"] or ""
    r = client.responses.create(model="r", input=QUESTION[0]["content"], max_output_tokens=8,
                                temperature=0)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text"
    assert (r.output[0].content[0].text, r.output_text) == (thinking, answer)
    assert r.usage.output_tokens_details.reasoning_tokens == \
        chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    events = list(client.responses.create(model="r", input=QUESTION[0]["content"],
                                          max_output_tokens=8, temperature=0, stream=True))
    types = [e.type for e in events]
    deltas = types.count("response.reasoning_text.delta")
    assert deltas >= 1 and types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added"]
    assert types[4:4 + deltas + 3] == ["response.reasoning_text.delta"] * deltas + [
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == thinking
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == thinking
    # A reasoning item given back goes to the template with the assistant's turn after
    # it: the same prompt as chat's reasoning_content, so the same reply.
    history = [{"role": "user", "content": "What is 2 + 2?"},
               {"type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": "two and two"}]},
               {"role": "assistant", "content": "4."}, {"role": "user", "content": "Sure?"}]
    again = client.responses.create(model="r", input=history, max_output_tokens=6,
                                    temperature=0)
    chat = post(url, "/v1/chat/completions", max_tokens=6, temperature=0, messages=[
        history[0], {**history[2], "reasoning_content": "two and two"}, history[3]]).json()
    assert again.output[0].content[0].text == chat["choices"][0]["message"]["reasoning_content"]
    plain = post(url, "/v1/chat/completions", max_tokens=6, temperature=0,
                 messages=[history[0], history[2], history[3]]).json()
    assert plain["choices"][0]["message"] != chat["choices"][0]["message"]
