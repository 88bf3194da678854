"""Structured output and tool calls end to end, with the default model (real weights)
behind the real processes, through the official openai client: every output parses
and validates against its schema, sampled or greedy, streamed or not."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

import processes

MODEL = "smol"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["cat", "dog", "fish"]}}},
          "required": ["name", "age", "pets"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"type": "string",
                                                               "maxLength": 20}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory, default_model_dir):
    with processes.local_stack(default_model_dir, tmp_path_factory.mktemp("smol"),
                               "--served-model-name", MODEL,
                               engine_args=("--kv-cache-memory-gb", "0.2",
                                            "--block-size", "16")) as front:
        yield front.url


@pytest.fixture(scope="module")
def client(smol):
    from openai import OpenAI

    return OpenAI(base_url=smol + "/v1", api_key="unused")


def _stream_text(stream) -> tuple[str, str]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_always_validate(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(6):  # sampled: every draw must still fit the schema
        kw = dict(model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=seed,
                  response_format=fmt)
        if stream:
            text, finish = _stream_text(client.chat.completions.create(stream=True, **kw))
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_the_completions_endpoint(client):
    # Any object: only the model decides when it ends (this prompt ends in ~170 tokens).
    ask = [{"role": "user", "content": "Give me a JSON object describing a person."}]
    out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=400,
                                         temperature=0, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    for extra in ({"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": PERSON}}},
                  {"guided_json": PERSON}):
        done = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=120,
                                         temperature=0.8, seed=1, extra_body=extra)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].text), PERSON)


def test_regex_choice_and_grammar(client):
    for seed in range(4):
        kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=seed)
        phone = client.chat.completions.create(
            extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"}, **kw).choices[0].message.content
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone)
        pick = client.chat.completions.create(
            extra_body={"guided_choice": ["red", "green", "blue"]}, **kw).choices[0]
        assert pick.message.content in ("red", "green", "blue") and pick.finish_reason == "stop"
        # GBNF (llama.cpp's EBNF); Lark is accepted too.
        gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
        said = client.chat.completions.create(
            extra_body={"guided_grammar": gbnf}, **kw).choices[0].message.content
        assert re.fullmatch(r"yes|no|maybe [0-9]", said), said


def outside_strings(text: str) -> str:
    """A JSON text without its string literals."""
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def test_vllms_structured_outputs_field(client, smol):
    """vLLM's structured_outputs (which replaced its guided_* fields in v0.12): the
    same constraints, and JSON's spacing."""
    kw = dict(model=MODEL, max_tokens=120, temperature=1.0)
    for seed in range(3):
        out = client.chat.completions.create(messages=ASK, seed=seed, **kw, extra_body={
            "structured_outputs": {"json": PERSON}}).choices[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.message.content), PERSON)
        tight = client.chat.completions.create(messages=ASK, seed=seed, **kw, extra_body={
            "structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
        text = tight.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
        assert not re.search(r"\s", outside_strings(text)), text
        done = client.completions.create(prompt="A colour:", seed=seed, **kw, extra_body={
            "structured_outputs": {"choice": ["red", "green", "blue"]}}).choices[0]
        assert done.text in ("red", "green", "blue") and done.finish_reason == "stop"
        phone = client.chat.completions.create(messages=ASK, seed=seed, **kw, extra_body={
            "structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}).choices[0].message.content
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone)
        said = client.chat.completions.create(messages=ASK, seed=seed, **kw, extra_body={
            "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
        assert said.choices[0].message.content in ("yes", "no")
    spaced = client.chat.completions.create(messages=ASK, seed=0, **kw, extra_body={
        "structured_outputs": {"json_object": True, "whitespace_pattern": "[ ]?"}})
    text = spaced.choices[0].message.content
    assert isinstance(json.loads(text), dict) and "\n" not in outside_strings(text)
    for so, param, fragment in (
            ({"json": PERSON, "regex": "a"}, "structured_outputs", "it gives json, regex"),
            ({}, "structured_outputs", "it gives none"),
            ({"structural_tag": "{}"}, "structured_outputs.structural_tag", "not a supported"),
            ({"regex": "a", "disable_any_whitespace": True}, "structured_outputs",
             "apply to json and json_object only"),
            ({"json": 5}, "structured_outputs.json", "must be a JSON schema"),
            ({"json": PERSON, "disable_additional_properties": False},
             "structured_outputs.disable_additional_properties", "additionalProperties: true")):
        r = httpx.post(smol + "/v1/chat/completions", timeout=60, json={
            "messages": ASK, "structured_outputs": so})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, error
        assert fragment in error["message"]
    r = httpx.post(smol + "/v1/completions", timeout=60, json={
        "prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}})
    assert r.status_code == 400 and "give at most one" in r.json()["error"]["message"]


def test_a_grammar_request_leaves_the_others_in_its_batch_unchanged(smol):
    """Greedy outputs of plain requests are the same whether a constrained request
    shares their batches or not (masks are per request)."""
    import asyncio

    async def run(with_grammar: bool):
        async with httpx.AsyncClient(base_url=smol, timeout=120) as c:
            plain = [c.post("/v1/completions", json={
                "model": MODEL, "prompt": f"Story {i}:", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}) for i in range(3)]
            extra = [c.post("/v1/completions", json={
                "model": MODEL, "prompt": "JSON:", "max_tokens": 60, "temperature": 0,
                "guided_json": PERSON})] if with_grammar else []
            replies = await asyncio.gather(*plain, *extra)
        assert all(r.status_code == 200 for r in replies)
        if with_grammar:
            jsonschema.validate(json.loads(replies[-1].json()["choices"][0]["text"]), PERSON)
        return [r.json()["choices"][0]["token_ids"] for r in replies[:3]]

    assert asyncio.run(run(True)) == asyncio.run(run(False))


def _check_calls(calls, tools):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_validate(client, stream):
    tools = [WEATHER, TIME]
    for seed in range(4):
        kw = dict(model=MODEL, messages=ASK_WEATHER, tools=tools, tool_choice="required",
                  max_tokens=150, temperature=1.0, seed=seed)
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            _check_calls(choice.message.tool_calls, tools)
            continue
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        # Each call: a first delta with its id and name, then its arguments in pieces.
        starts = [d for d in deltas if d.id is not None]
        assert [d.index for d in starts] == list(range(len(starts)))
        assert len(deltas) > len(starts)
        calls = [start.model_copy(update={"function": start.function.model_copy(update={
            "arguments": "".join(d.function.arguments or "" for d in deltas
                                 if d.index == start.index)})}) for start in starts]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        _check_calls(calls, tools)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_forces_its_arguments(client, stream):
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=80,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for seed in range(3):
        if not stream:
            choice = client.chat.completions.create(temperature=1.0, seed=seed, **kw).choices[0]
            [call] = choice.message.tool_calls
            assert choice.message.content is None and choice.finish_reason == "tool_calls"
        else:
            chunks = list(client.chat.completions.create(temperature=1.0, seed=seed,
                                                         stream=True, **kw))
            deltas = [tc for c in chunks if c.choices
                      for tc in (c.choices[0].delta.tool_calls or [])]
            assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
            arguments = "".join(d.function.arguments or "" for d in deltas)
            call = deltas[0].model_copy(update={"function": deltas[0].function.model_copy(
                update={"arguments": arguments})})
        assert call.function.name == "get_weather"
        _check_calls([call], [WEATHER])


def test_tool_choice_none_and_auto_and_the_conversation_back(client, smol):
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    # "auto" needs a template that writes calls; SmolLM2's has none: a 400 that says so.
    r = httpx.post(smol + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER], "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "'required' or a named function" in r.json()["error"]["message"]
    # A conversation with a call and its result goes back to the model.
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    # The call reached the prompt (as JSON text: the template has no tool_calls).
    tokens = httpx.post(smol + "/tokenize", json={"model": MODEL, "messages": history}).json()
    text = httpx.post(smol + "/detokenize", json={"model": MODEL,
                                                  "tokens": tokens["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "18 C" in text


# -- the Responses API's function tools (frontend/responses_api.py) -------------------

RESP_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_function_calls_are_output_items_as_on_chat(client):
    kw = dict(model=MODEL, temperature=0, max_output_tokens=80, tools=[RESP_WEATHER],
              tool_choice="required", parallel_tool_calls=False)
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=80, tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False)
    (expected,) = chat.choices[0].message.tool_calls
    r = client.responses.create(input=ASK_WEATHER[0]["content"], **kw)
    assert r.status == "completed" and r.tool_choice == "required"
    (call,) = r.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id == "fc_" + r.id.removeprefix("resp_") and call.call_id.startswith("call_")
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    # Streamed: the item added, its arguments as they are generated, done; the same call.
    events = list(client.responses.create(input=ASK_WEATHER[0]["content"], stream=True, **kw))
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        *[d.type for d in deltas], "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, (done, item_done, completed) = events[2], events[-3:]
    assert added.item.arguments == "" and added.item.status == "in_progress"
    assert "".join(d.delta for d in deltas) == done.arguments == call.arguments
    assert item_done.item.arguments == call.arguments
    assert completed.response.output[0].call_id == added.item.call_id
    # A named function: its arguments stream as they are generated.
    events = list(client.responses.create(
        model=MODEL, input=ASK_WEATHER[0]["content"], temperature=0, max_output_tokens=80,
        tools=[RESP_WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    final = events[-1].response.output[0]
    assert len(pieces) > 1 and "".join(pieces) == final.arguments
    jsonschema.validate(json.loads(final.arguments), WEATHER["function"]["parameters"])


def test_responses_take_calls_and_their_outputs_as_chats_tool_messages(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, tools=[WEATHER], tool_choice="none",
        messages=ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    r = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=8, tools=[RESP_WEATHER],
        tool_choice="none",
        input=ASK_WEATHER + [{"type": "function_call", "call_id": "call_1", "name": "get_weather",
                              "arguments": '{"city": "Paris"}'},
                             {"type": "function_call_output", "call_id": "call_1",
                              "output": "18 C"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens

