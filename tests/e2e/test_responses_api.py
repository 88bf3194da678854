"""OpenAI's Responses API (/v1/responses) end to end: real engine, tokenizer pool and
frontend processes, through OpenAI's own client."""

from __future__ import annotations

import json

import httpx
import pytest

import processes
# The module's stack (started once for this module).
from frontend_stacks import stack, wait_engine_idle  # noqa: F401

INSTRUCTIONS, QUESTION = "Be brief.", "Name a color."


@pytest.fixture(scope="module")
def slow(tmp_path_factory, tiny_llama_dir, stack):  # noqa: F811
    """An engine at 20 ms a step behind a frontend with a 2-s request timeout."""
    d = tmp_path_factory.mktemp("slow")
    engine = processes.engine(tiny_llama_dir, f"ipc://{d}/engine.sock",
                              env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02"})
    front = processes.frontend(tiny_llama_dir, engine.address, stack["pool"].address,
                               "--served-model-name", "tiny-llama", "--request-timeout", "2")
    try:
        processes.wait_healthy(front)
        yield {"engine": engine, "url": front.url}
    finally:
        for p in (front, engine):
            p.stop()


@pytest.fixture(scope="module")
def client(stack):  # noqa: F811
    from openai import OpenAI

    return OpenAI(base_url=stack["url"] + "/v1", api_key="unused")


def chat_reference(client, max_tokens: int):
    """The same conversation through /v1/chat/completions, greedy."""
    return client.chat.completions.create(
        model="tiny-llama", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])


def test_a_response_is_the_chat_completion_of_its_input(client):
    for max_tokens in (5, 40):
        chat = chat_reference(client, max_tokens)
        r = client.responses.create(model="tiny-llama", instructions=INSTRUCTIONS,
                                     input=QUESTION, max_output_tokens=max_tokens,
                                     temperature=0)
        assert r.id.startswith("resp_") and r.object == "response"
        assert r.output_text == chat.choices[0].message.content
        (item,) = r.output
        assert item.type == "message" and item.role == "assistant"
        assert item.id == "msg_" + r.id.removeprefix("resp_")
        finished = chat.choices[0].finish_reason == "stop"
        assert r.status == ("completed" if finished else "incomplete")
        assert r.incomplete_details is None if finished else (
            r.incomplete_details.reason == "max_output_tokens")
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.usage.output_tokens == chat.usage.completion_tokens
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # The same conversation as a list of messages, text parts and all.
    listed = client.responses.create(model="tiny-llama", max_output_tokens=5, temperature=0,
                                     input=[{"role": "system", "content": INSTRUCTIONS},
                                            {"type": "message", "role": "user", "content": [
                                                {"type": "input_text", "text": QUESTION}]}])
    assert listed.output_text == chat_reference(client, 5).choices[0].message.content


def test_a_streamed_response_is_openais_event_sequence(client):
    events = list(client.responses.create(model="tiny-llama", instructions=INSTRUCTIONS,
                                          input=QUESTION, max_output_tokens=6, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    final = events[-1].response
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", f"response.{final.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == chat_reference(client, 6).choices[0].message.content
    assert events[5 + deltas - 1].text == text and events[-2].item.content[0].text == text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert final.usage.output_tokens == 6 or final.status == "completed"


def test_logprobs_when_included_are_chats(client):
    chat = client.chat.completions.create(
        model="tiny-llama", max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])
    expected = [t.model_dump() for t in chat.choices[0].logprobs.content]
    ask = dict(model="tiny-llama", instructions=INSTRUCTIONS, input=QUESTION,
               max_output_tokens=6, temperature=0, top_logprobs=2,
               include=["message.output_text.logprobs"])
    r = client.responses.create(**ask)
    part = r.output[0].content[0]
    assert [t.model_dump() for t in part.logprobs] == expected
    assert all(len(t["top_logprobs"]) == 2 for t in expected) and len(expected) == 6
    events = list(client.responses.create(stream=True, **ask))
    streamed = [t.model_dump() for e in events if e.type == "response.output_text.delta"
                for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert streamed == [t.model_dump() for t in done.logprobs] == expected
    # Not asked for: none.
    plain = client.responses.create(**{k: v for k, v in ask.items() if k != "include"})
    assert plain.output[0].content[0].logprobs == []


def test_structured_output_through_text_format(client):
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}},
              "required": ["c"]}
    r = client.responses.create(model="tiny-llama", input="JSON please", max_output_tokens=60,
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "count", "schema": schema}})
    assert r.status == "completed", r.output_text  # the grammar ends it
    assert json.loads(r.output_text)["c"] in ("red", "blue")


@pytest.mark.parametrize("fields, param, fragment", [
    ({"store": True}, "store", "keeps no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "no response is stored"),
    ({"background": True}, "background", "not served"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "summaries are not made"),
    ({"reasoning": {"effort": "max"}}, "reasoning.effort", "'minimal', 'low', 'medium'"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tool 0 has type 'web_search'; only function"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"}, "tool_choice",
     "needs a model whose chat template writes tool calls"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input",
     "item 0 has type 'item_reference'"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input",
     "item 0.encrypted_content"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input",
     "item 0.call_id: Field required"),
    ({"include": ["reasoning.encrypted_content"]}, "include",
     "only 'message.output_text.logprobs' may be included"),
    ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"input": ""}, "input", "input is empty"),
    ({"input": []}, "input", "input is empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "item 0.content: content part 0 has type 'input_image'"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input", "item 0.role"),
    ({"input": {"role": "user"}}, "input", "a text or a list of items"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs a name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
     "text.format.schema", ""),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 10**6}, "max_tokens", "maximum context length"),
    ({"service_tier": "flex"}, "service_tier", ""),
    ({"seed": 1}, "seed", "'seed' is not a supported parameter"),
])
def test_what_a_response_cannot_be_is_a_400_naming_it(stack, fields, param, fragment):  # noqa: F811
    body = {"model": "tiny-llama", "input": "Hi", "max_output_tokens": 2, **fields}
    for stream in (False, True):
        r = httpx.post(stack["url"] + "/v1/responses", json={**body, "stream": stream},
                       timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and fragment in error["message"], error


def test_an_unknown_model_is_404_and_every_response_has_its_request_id(stack):  # noqa: F811
    r = httpx.post(stack["url"] + "/v1/responses", json={"model": "gpt-4", "input": "Hi"},
                   timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(stack["url"] + "/v1/responses", timeout=60, json={
        "model": "tiny-llama", "input": "Hi", "max_output_tokens": 2, "store": False,
        "metadata": {"k": "v"}, "tool_choice": "auto", "truncation": "disabled"})
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]


def test_a_response_stream_the_timeout_cuts_ends_failed(slow):
    # /v1/responses ends with OpenAI's error and response.failed events, no [DONE].
    with httpx.stream("POST", slow["url"] + "/v1/responses", timeout=60, json={
            "model": "tiny-llama", "input": "Hi", "max_output_tokens": 400,
            "temperature": 0, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert kinds == [d["type"] for d in data]  # each event named as its data says
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-2]) == {"response.output_text.delta"} and kinds[-2:] == [
        "error", "response.failed"]
    assert data[-2]["code"] == "request_timeout"
    failed = data[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "request_timeout"
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    stats = wait_engine_idle(slow["engine"].address)
    assert stats.num_running == 0 and stats.num_blocks_used == 0

