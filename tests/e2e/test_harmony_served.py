"""gpt-oss's harmony replies end to end over the real processes and HTTP, scripted (the
engine's logits forced: tests/fault_plugin.py) on a tiny model whose template writes
harmony: the analysis channel as reasoning, the final one as the answer, calls to
functions as tool calls (the parser alone: tests/unit/test_harmony.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer

import processes
from conftest import HARMONY_ANSWER as ANSWER, HARMONY_CALL as CALL, HARMONY_THINK as THINK
from frontend_stacks import sse_events


def test_another_parser_for_a_harmony_model_stops_the_frontend_at_start(tmp_path,
                                                                          tiny_harmony_dir):
    front = processes.frontend(tiny_harmony_dir, f"ipc://{tmp_path}/e.sock",
                               f"ipc://{tmp_path}/t.sock", "--reasoning-parser", "qwen3")
    try:
        front.proc.wait(timeout=60)
        assert front.proc.returncode != 0
        assert ("writes gpt-oss's harmony format, which the qwen3 reasoning parser does not "
                "read; use --reasoning-parser gpt_oss") in front.output()
    finally:
        front.stop()


QUESTIONS = {"think": THINK + ANSWER, "weather": THINK + CALL,
             "pick": THINK + "<|start|>assistant<|channel|>final<|message|>"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_harmony_dir):
    """The frontend picks the gpt_oss parser by itself (the template writes harmony);
    a question's word (a token of its own) scripts its reply."""
    tok = Tokenizer.from_file(str(tiny_harmony_dir / "tokenizer.json"))
    scripts = {}
    for word, reply in QUESTIONS.items():
        [trigger] = tok.encode(word, add_special_tokens=False).ids
        scripts[str(trigger)] = tok.encode(reply, add_special_tokens=False).ids
    run = tmp_path_factory.mktemp("harmony")
    with processes.local_stack(tiny_harmony_dir, run, "--served-model-name", "h",
                               engine_env={"ROSESERVE_FAULT_SCRIPTS": json.dumps(scripts)}
                               ) as front:
        yield front.url, tok


def chat(url: str, word: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "h", "messages": [{"role": "user", "content": word}], "max_tokens": 40,
        "temperature": 0, **body})


def test_the_analysis_is_reasoning_and_the_final_channel_the_answer(stack):
    url, tok = stack
    r = chat(url, "think")
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"],
            choice["finish_reason"]) == ("Two and two. Four?", "It is 4.", "stop")
    script = tok.encode(QUESTIONS["think"], add_special_tokens=False).ids
    thought = len(tok.encode(THINK, add_special_tokens=False).ids)
    assert body["usage"]["completion_tokens"] == len(script)   # <|return|> stopped it
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": "h", "messages": [{"role": "user", "content": "think"}],
            "max_tokens": 40, "temperature": 0, "stream": True}) as s:
        events = sse_events(s)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two. Four?"
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    # completions are raw: no parser, special tokens skipped as asked
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "h", "prompt": "think", "max_tokens": 40, "temperature": 0})
    assert r.json()["choices"][0]["text"] == "analysisTwo and two. Four?assistantfinalIt is 4."


def test_earlier_thinking_reaches_the_template_as_thinking(stack):
    """gpt-oss's template reads an assistant message's analysis as ``thinking``."""
    url, tok = stack
    r = httpx.post(url + "/tokenize", timeout=60, json={"model": "h", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
        {"role": "user", "content": "bye"}]})
    assert tok.decode(r.json()["tokens"], skip_special_tokens=False) == (
        "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>analysis<|message|>"
        "A greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|end|>"
        "<|start|>user<|message|>bye<|end|><|start|>assistant")


def test_reasoning_effort_reaches_the_template(stack):
    """OpenAI's reasoning_effort (chat) and reasoning.effort (Responses) set the
    template's reasoning_effort, which gpt-oss's writes into its system message."""
    url, tok = stack
    r = chat(url, "hi", max_tokens=1, reasoning_effort="high", return_token_ids=True)
    assert r.status_code == 200, r.text
    prompt = tok.decode(r.json()["choices"][0]["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.startswith("<|start|>system<|message|>Reasoning: high<|end|>")
    r = httpx.post(url + "/v1/responses", timeout=60, json={
        "model": "h", "input": "hi", "max_output_tokens": 1, "reasoning": {"effort": "low"}})
    assert r.status_code == 200, r.text
    r = chat(url, "hi", max_tokens=1, reasoning_effort="high",
             chat_template_kwargs={"reasoning_effort": "low"})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_to_a_function_is_a_tool_call(stack, stream):
    url, _ = stack
    r = chat(url, "weather", tools=[WEATHER_TOOL], stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        name = "".join(c["function"].get("name") or "" for c in calls)
        arguments = "".join(c["function"].get("arguments") or "" for c in calls)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        message = r.json()["choices"][0]["message"]
        [call] = message["tool_calls"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        reasoning, finish = message["reasoning_content"], r.json()["choices"][0]["finish_reason"]
        assert message["content"] is None
    assert (name, json.loads(arguments), reasoning, finish) == (
        "get_weather", {"city": "Paris"}, "Two and two. Four?", "tool_calls")


def test_a_response_thinks_then_calls(stack):
    """/v1/responses: the analysis as a reasoning item, the call as a function_call
    item, with the reasoning tokens counted."""
    url, tok = stack
    r = httpx.post(url + "/v1/responses", timeout=60, json={
        "model": "h", "input": "weather", "max_output_tokens": 40,
        "tools": [{"type": "function", **WEATHER_TOOL["function"]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["reasoning", "function_call"], body["output"]
    assert body["output"][0]["content"][0]["text"] == "Two and two. Four?"
    call = body["output"][1]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    thought = len(tok.encode(THINK, add_special_tokens=False).ids)
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == thought


def test_a_call_without_tools_goes_with_the_thinking(stack):
    """No tools in the request: a message to a function is the model's own business,
    not text for the user (no tags of the tool-call reader reach the reply)."""
    url, _ = stack
    r = chat(url, "weather")
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"], message.get("tool_calls")) == (
        'Two and two. Four?{"city": "Paris"}', None, None)


def test_a_grammar_waits_for_the_final_channel(stack):
    """The analysis and the final header are scripted; the grammar, held back until
    <|channel|>final<|message|>, then makes the answer one of the choices."""
    url, _ = stack
    r = chat(url, "pick", guided_choice=["yes", "no"], max_tokens=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "Two and two. Four?"
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
