"""Tool calls without a model: the plan a tool_choice makes, the grammar it forces,
parsing text into OpenAI tool_calls piece by piece, and tools reaching a template."""

from __future__ import annotations

import json

import pytest

from common.errors import InvalidRequestError
from common.protocol import ChatMessage, TokenizeRequest
from frontend.openai_protocol import ChatCompletionRequest
from frontend.tools import ToolCallParser, ToolPlan, plan_tools
from helpers import WEATHER

HERMES_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                   "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                   "Answer with <tool_call>{...}</tool_call> to call one.")
LLAMA3_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                   'Respond in the format {"name": function name, "parameters": dictionary of '
                   'argument name and its value}. Do not use variables.')


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def pieces(parser: ToolCallParser, text: str, size: int):
    """Feed ``text`` in pieces of ``size`` characters; content and calls out."""
    content, calls = "", []
    for i in range(0, len(text), size):
        c, k = parser.push(text[i:i + size])
        content, calls = content + c, calls + k
    c, k = parser.finish()
    return content + c, calls + k


def test_plans():
    assert plan_tools(request(), None) is None
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), None) is None
    required = plan_tools(request(tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False), None)
    schema = json.loads(required.structured.spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    named = plan_tools(request(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None)
    assert named.name == "get_weather"
    assert json.loads(named.structured.spec) == WEATHER["function"]["parameters"]
    assert plan_tools(request(tools=[WEATHER]), HERMES_TEMPLATE).mode == "auto"
    assert plan_tools(request(tools=[WEATHER]), HERMES_TEMPLATE).syntax == "hermes"
    assert plan_tools(request(tools=[WEATHER]), LLAMA3_TEMPLATE).syntax == "llama3_json"
    for kw, template, fragment in (
            ({"tools": [WEATHER]}, "no tools here", "'required' or a named function"),
            ({"tool_choice": "required"}, None, "needs tools"),
            ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                 "function": {"name": "nope"}}},
             None, "not among the tools")):
        with pytest.raises(InvalidRequestError, match=fragment) as info:
            plan_tools(request(**kw), template)
        assert info.value.param == "tool_choice"
    with pytest.raises(ValueError, match="two tools are named"):
        request(tools=[WEATHER, WEATHER])


def streamed_calls(parser: ToolCallParser, text: str, size: int) -> list[list[dict]]:
    """The call pieces of each push of ``text`` in pieces of ``size``, then finish's."""
    pieces = [parser.push(text[i:i + size])[1] for i in range(0, len(text), size)]
    return pieces + [parser.finish()[1]]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_required_calls_stream_as_they_are_generated(size):
    first_args = '{"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}'
    text = (f'[{{"name": "get_weather", "arguments": {first_args}}}, '
            '{"name": "get_time", "arguments": {}}]')
    parser = ToolCallParser(ToolPlan("required", None))
    pieces = streamed_calls(parser, text, size)
    flat = [call for piece in pieces for call in piece]
    starts = [c for c in flat if "id" in c]
    assert [(c["index"], c["function"]["name"]) for c in starts] == [
        (0, "get_weather"), (1, "get_time")]
    sent = ["".join(c["function"]["arguments"] for c in flat if c["index"] == i)
            for i in (0, 1)]
    assert sent == [first_args, "{}"]  # as the model wrote them, whole
    assert [c["function"]["arguments"] for c in parser.calls] == sent
    if size == 1:  # the first call began with its name and grew with each character
        began = next(i for i, piece in enumerate(pieces) if piece)
        assert text[:began + 1].endswith('"get_weather"')
        assert sum(1 for piece in pieces if any(c["index"] == 0 for c in piece)) > 40
        assert all(len(piece) == 1 for piece in pieces if piece)  # one entry per chunk


def test_a_required_call_cut_short():
    # max_tokens ended it before a name was whole: the raw text, no calls
    cut = '[{"name": "get_wea'
    parser = ToolCallParser(ToolPlan("required", None))
    assert parser.push(cut) == ("", [])
    assert parser.finish() == (cut, [])
    # after it: the call, with the arguments it got (the finish reason says "length")
    parser = ToolCallParser(ToolPlan("required", None))
    _, calls = parser.push('[{"name": "get_weather", "arguments": {"ci')
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert parser.finish() == ("", []) and len(parser.calls) == 1
    whole = ToolCallParser(ToolPlan("required", None))
    _, calls = whole.push('[{"name": "f", "arguments": {}}]')
    assert len(calls) == 1 and whole.finish() == ("", [])


def test_named_call_streams_its_arguments():
    parser = ToolCallParser(ToolPlan("named", None, name="f"))
    _, first = parser.push('{"a"')
    _, more = parser.push(': 1}')
    assert first[0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert first[0]["id"].startswith("call_")
    assert more == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert parser.calls[0]["function"]["arguments"] == '{"a": 1}'


def merged(deltas: list[dict]) -> list[dict]:
    """Streamed call pieces as whole calls: a first piece with id and name, the rest
    arguments, by index."""
    calls: list[dict] = []
    for d in deltas:
        if "id" in d:
            calls.append({**d, "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_hermes_calls_are_cut_out_of_the_text(size):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call> and <tool_call>not json</tool_call> done '
            '<tool_call>{"arguments": {"x": "</tool_call>"}, "name": "f"} </tool_call>'
            '<tool_call> {"name": "g", "parameters": "{\\"y\\": 1}"}'  # left open
            '<tool_call>{"name": "h", "arguments": {}}</tool_call><tool')
    content, deltas = pieces(ToolCallParser(ToolPlan("auto", None)), text, size)
    assert content == "Let me check.  and <tool_call>not json</tool_call> done <tool"
    calls = merged(deltas)
    assert [(c["index"], c["function"]["name"]) for c in calls] == [
        (0, "get_weather"), (1, "f"), (2, "g"), (3, "h")]
    assert [c["function"]["arguments"] for c in calls] == [
        '{"city": "Paris"}', '{"x": "</tool_call>"}', '{"y": 1}', "{}"]
    if size == 1:  # the first call's arguments streamed, a piece a character
        assert sum(1 for d in deltas if d["index"] == 0) == len('{"city": "Paris"}') + 1


def test_a_hermes_call_cut_short():
    for text, content, calls in [
            # its name whole: the call, with the arguments it got
            ('Hi <tool_call>{"name": "f", "arguments": {"a": [1, ', "Hi ", [("f", '{"a": [1, ')]),
            # before that: text, as any unterminated call
            ('Hi <tool_call>{"name": "f', 'Hi <tool_call>{"name": "f', []),
            ('Hi <tool_call> ', "Hi <tool_call> ", [])]:
        parser = ToolCallParser(ToolPlan("auto", None))
        got, deltas = pieces(parser, text, 3)
        assert got == content
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in merged(deltas)] == calls


LLAMA3 = ToolPlan("auto", None, syntax="llama3_json")


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", " \n"])
def test_llama3_replies_of_calls_become_calls(size, prefix):
    text = (prefix + '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
    content, calls = pieces(ToolCallParser(LLAMA3), text, size)
    assert content == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"}, {"city": "Oslo"}]
    assert [c["index"] for c in calls] == [0, 1]


def test_llama3_text_flows_and_what_is_not_calls_stays_text():
    parser = ToolCallParser(LLAMA3)
    assert parser.push(" It is") == (" It is", [])  # not a call: released at once
    assert parser.push(' {"name": "x"}') == (' {"name": "x"}', [])
    assert parser.finish() == ("", []) and parser.calls == []
    for reply in ('{"name": "get_weather", "parameters": {"ci',  # cut by max_tokens
                  '{"city": "Paris"}',  # JSON, but not a call
                  '{"name": "f", "parameters": {}} and some words', "<|py"):
        parser = ToolCallParser(LLAMA3)
        assert parser.push(reply) == ("", [])  # it may be a call until it ends
        assert parser.finish() == (reply, []), reply


LLAMA3_TOOLS = ToolPlan("auto", None, syntax="llama3_json",
                        tool_names=("get_weather", "get_time"))


def test_a_llama3_plan_knows_the_tools_names():
    plan = plan_tools(request(tools=[WEATHER]), LLAMA3_TEMPLATE)
    assert plan.tool_names == ("get_weather",)


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", " \n"])
def test_llama3_calls_stream_once_a_name_is_a_tools(size, prefix):
    first_args = '{"city": "Pa\\"ris}", "days": [1, 2]}'
    text = (prefix + f'{{"name": "get_weather", "parameters": {first_args}}}; '
            '{"name": "get_time", "arguments": {}}\n')
    parser = ToolCallParser(LLAMA3_TOOLS)
    content, deltas = pieces(parser, text, size)
    assert content == ""
    calls = merged(deltas)
    assert [(c["index"], c["function"]["name"]) for c in calls] == [
        (0, "get_weather"), (1, "get_time")]
    assert [c["function"]["arguments"] for c in calls] == [first_args, "{}"]
    if size == 1:  # the call began once its name was whole, then grew with the text
        parser = ToolCallParser(LLAMA3_TOOLS)
        got = streamed_calls(parser, text, 1)
        began = next(i for i, piece in enumerate(got) if piece)
        assert text[:began + 1].endswith('"get_weather"')
        assert sum(1 for piece in got if any(c["index"] == 0 for c in piece)) > 20


def test_llama3_calls_of_the_tools_keep_what_they_got_and_what_follows():
    for reply, content, calls in [
            # cut short by max_tokens: the call, with the arguments it got
            ('{"name": "get_weather", "parameters": {"ci', "", [("get_weather", '{"ci')]),
            # words after the calls are content
            ('{"name": "get_time", "parameters": {}} and some words', "and some words",
             [("get_time", "{}")]),
            # a first name that is none of the tools: held, then whole calls or text
            ('{"name": "other", "parameters": {"a": 1}}', "", [("other", '{"a": 1}')]),
            ('{"name": "other", "parameters": {}} and words',
             '{"name": "other", "parameters": {}} and words', []),
            ('{"city": "Paris"}', '{"city": "Paris"}', [])]:
        parser = ToolCallParser(LLAMA3_TOOLS)
        got, deltas = pieces(parser, reply, 2)
        assert got == content, reply
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in merged(deltas)] == calls, reply


MISTRAL = ToolPlan("auto", None, syntax="mistral")


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("reply", [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',  # v3 tokenizers
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]'
    '{"city": "Oslo"}'])  # v11 on
def test_mistral_calls_become_calls(size, reply):
    content, deltas = pieces(ToolCallParser(MISTRAL), "Checking. " + reply, size)
    assert content == "Checking. "
    calls = merged(deltas)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"}, {"city": "Oslo"}]
    assert [c["index"] for c in calls] == [0, 1]
    # Mistral's templates take back only ids of 9 letters and digits.
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    if size == 1:  # streamed: each call's arguments a character at a time
        assert sum(1 for d in deltas if d["index"] == 0) >= len('{"city": "Paris"}')


def test_mistral_text_flows_and_what_is_not_calls_stays_text():
    parser = ToolCallParser(MISTRAL)
    assert parser.push("It is [TOOL") == ("It is ", [])  # may begin the tag
    assert parser.push("S] sunny") == ("[TOOLS] sunny", [])
    for reply in ('[TOOL_CALLS] [{"name": "get_wea',  # cut by max_tokens before a name
                  '[TOOL_CALLS] [{"city": "x"}]', "[TOOL_CALLS]", "[TOOL_CALLS]f[ARGS] 7",
                  "[TOOL_CALLS][ARGS]{}"):
        parser = ToolCallParser(MISTRAL)
        assert parser.push(reply) == ("", [])
        assert parser.finish() == (reply, []), reply
    # Once a name is whole the call is made, and keeps the arguments it got.
    for reply, arguments in (('[TOOL_CALLS] [{"name": "f", "arguments": {"a', '{"a'),
                             ('[TOOL_CALLS]f[ARGS]{"a": [1', '{"a": [1')):
        content, deltas = pieces(ToolCallParser(MISTRAL), reply, 4)
        assert content == "" and [(c["function"]["name"], c["function"]["arguments"])
                                  for c in merged(deltas)] == [("f", arguments)]
    assert plan_tools(request(tools=[WEATHER]), "... [TOOL_CALLS] ...") == MISTRAL
    assert MISTRAL.keeps_special_tokens and not LLAMA3.keeps_special_tokens


def test_hermes_holds_back_only_what_may_begin_a_call():
    parser = ToolCallParser(ToolPlan("auto", None))
    assert parser.push("Hello <to") == ("Hello ", [])
    assert parser.push("y>") == ("<toy>", [])


def test_tools_and_calls_reach_the_template(tiny_llama_dir, tmp_path):
    from tokenizer_worker.prompt_tokenizer import PromptTokenizer

    tok = PromptTokenizer(tiny_llama_dir, 10_000)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", content="", tool_calls=[call]),
                ChatMessage(role="tool", content="18 C", tool_call_id="c1")]
    # The tiny model's template renders no tools: the call is shown as JSON content.
    text = tok.render(TokenizeRequest(request_id="r", messages=messages, tools=[WEATHER]))
    assert '[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text
    assert "18 C" in text
    tok.tokenizer.chat_template = HERMES_TEMPLATE
    text = tok.render(TokenizeRequest(request_id="r", messages=messages[:1], tools=[WEATHER]))
    assert text.startswith("user: weather?\ntools: [") and '"get_weather"' in text
