"""Tool calling: which calls a chat request may make, the grammar that forces them,
and turning the generated text into OpenAI ``tool_calls``, whole or streamed.

- ``tool_choice`` "required" forces a JSON array of calls, each
  ``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}``
  (one call when ``parallel_tool_calls`` is false); a named function forces its
  arguments alone. Both work with any model: the grammar, not the model's training,
  guarantees the shape, and the arguments always match the function's schema.
- "auto" lets the model choose between text and calls, so it needs a model trained
  to write calls in a known format, which its chat template shows. roseserve parses
  three. Hermes: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` within
  the text (Qwen 2.5/3, Hermes and others; the template names ``<tool_call>``), a
  call streamed once its name is whole.
  Mistral's: ``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{...}`` per
  call with its newer tokenizers (the template names ``[TOOL_CALLS]``); these are
  special tokens, which the text of such a request keeps; text before the tag flows,
  and from it on the calls stream. Granite's (3.x): ``<|tool_call|>`` then a JSON list
  of calls (the template names ``<|tool_call|>``), read as Mistral's list.
  Llama 3's JSON: the whole reply
  one or more ``{"name": ..., "parameters": ...}`` objects, separated by ``;``, maybe
  after ``<|python_tag|>`` (Llama 3.1-3.3, whose templates ask for "the format
  {"name": function name, "parameters": ...}"); a reply that starts as anything
  else is text, released as it comes. One that starts with ``{`` is calls, streamed,
  once its first name is one of the request's tools (text after the calls is
  content); else it is held until it ends, and is calls if it parses as nothing but
  calls, else text. gpt-oss's harmony: a message to ``functions.NAME`` (its parser,
  frontend/harmony.py, hands it on as a Hermes call). For any
  other template "auto" is refused with a 400 that says to use "required" or a
  named function. The default model's template has no tool support.
- "none" (the default without tools) generates text; the tools still reach the
  template, as in OpenAI's API.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

from common.errors import InvalidRequestError
from common.structured import StructuredOutput, json_schema_output
from frontend.detokenizer import StreamSplitter, partial_suffix
from frontend.harmony import is_harmony
from frontend.openai_protocol import ChatCompletionRequest

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
# Mistral's: special tokens, kept in the text of a request that may make calls.
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# Granite 3's: a special token, then the calls' JSON list.
GRANITE_CALLS = "<|tool_call|>"
# What Llama 3.1-3.3's templates ask a model with tools to answer in.
LLAMA3_FORMAT = '"parameters": dictionary of argument name and its value'
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "required", "named" or "auto"
    structured: Optional[StructuredOutput]
    name: Optional[str] = None  # the named function
    # auto: how the model writes calls ("hermes", "mistral", "granite", "llama3_json").
    syntax: str = "hermes"
    # llama3_json: the request's tools, whose names make a reply that starts with "{"
    # calls as soon as its first name is whole.
    tool_names: tuple[str, ...] = ()

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the reply's text must keep special tokens (Mistral's and Granite's
        calls are)."""
        return self.mode == "auto" and self.syntax in ("mistral", "granite")

    @property
    def tag(self) -> str:
        """What starts the calls of a reply that writes them after a tag."""
        return GRANITE_CALLS if self.syntax == "granite" else MISTRAL_CALLS


def plan_tools(body: ChatCompletionRequest, chat_template: Optional[str]) -> Optional[ToolPlan]:
    """How the request's tools are served; None when no calls can be made."""
    choice = body.tool_choice
    tools = body.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError(f"tool_choice {_describe(choice)} needs tools", "tool_choice")
    if choice == "auto":
        template = chat_template or ""
        # harmony (gpt-oss): its parser hands calls on in Hermes' tags (frontend/harmony.py)
        if HERMES_START in template or is_harmony(template):
            return ToolPlan("auto", None)
        if MISTRAL_CALLS in template:
            return ToolPlan("auto", None, syntax="mistral")
        if GRANITE_CALLS in template:
            return ToolPlan("auto", None, syntax="granite")
        if LLAMA3_FORMAT in template:
            return ToolPlan("auto", None, syntax="llama3_json",
                            tool_names=tuple(t.function.name for t in tools))
        raise InvalidRequestError(
            "tool_choice 'auto' needs a model whose chat template writes tool calls in a "
            "format roseserve parses (Hermes <tool_call>, Mistral's [TOOL_CALLS], Granite's "
            "<|tool_call|>, Llama 3's JSON or gpt-oss's harmony); this model's "
            "template does not. Use tool_choice 'required' or a named function: the "
            "output is then forced to a valid call", "tool_choice")
    if choice == "required":
        calls = {"type": "array", "minItems": 1,
                 "items": {"anyOf": [_call_schema(t.function.name, t.function.parameters)
                                     for t in tools]}}
        if not body.parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolPlan("required", json_schema_output(calls, "tools"))
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not "
                                  f"among the tools", "tool_choice")
    return ToolPlan("named", json_schema_output(_parameters(tool.function.parameters),
                                                f"tools.{name}.parameters"), name=name)


def _describe(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _parameters(schema: Optional[dict]) -> dict:
    return schema if schema else {"type": "object", "properties": {}}


def _call_schema(name: str, parameters: Optional[dict]) -> dict:
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": _parameters(parameters)},
            "required": ["name", "arguments"]}


def new_call(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class _CallReader:
    """One call's JSON object, ``{"name": ..., "arguments": ...}`` (or "parameters"),
    read as its text arrives (an item of a "required" array or of Mistral's list, a
    Hermes call's body): its name once that string is whole, and where the text of its
    arguments starts and (once it has) ends."""

    pos: int                   # the next character of the reply to read
    depth: int = 0
    string_start: int = -1     # inside a string: where it began
    escaped: bool = False
    key: Optional[str] = None  # the key whose value is being read, at the top level
    in_value: bool = False
    name: Optional[str] = None
    args_start: int = -1
    args_end: int = -1
    end: int = -1              # just after its closing brace
    call: Optional[dict] = None   # once its name is whole
    sent: int = 0              # how far its arguments' text has been sent
    # Mistral's name[ARGS]{...}: the object is the arguments, named by the caller.
    arguments_only: bool = False

    def read(self, text: str) -> None:
        i = self.pos
        while i < len(text) and self.end < 0:
            c, top = text[i], self.depth == 1 and not self.arguments_only
            if self.string_start >= 0:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    if top and not self.in_value:
                        self.key = json.loads(text[self.string_start:i + 1])
                    elif top and self.key == "name":
                        self.name = json.loads(text[self.string_start:i + 1])
                    elif top and self.key in ARGUMENT_KEYS:
                        self.args_end = i + 1
                    self.string_start = -1
            elif c == '"' or c in "{[":
                if top and self.in_value and self.key in ARGUMENT_KEYS:
                    self.args_start = i
                if c == '"':
                    self.string_start = i
                else:
                    self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
                    if self.arguments_only:
                        self.args_end = self.end
                elif self.depth == 1 and self.in_value and self.key in ARGUMENT_KEYS:
                    self.args_end = i + 1
            elif top and c in ":,":
                self.in_value = c == ":"
            i += 1
        self.pos = i


@dataclass
class ToolCallParser(StreamSplitter):
    """One choice's text turned into content and tool calls, as it streams.

    ``push(text)`` returns (content released now, calls or pieces of calls now: a
    call's first carries its id and name); ``finish()`` returns the same for what is
    left at the end (with "required", the raw text when no call began). Calls carry
    their stream index. A named function's arguments, and each call of a "required"
    array or of a Hermes or Mistral reply once its name is whole, stream as they are
    generated, as the model wrote them; a call cut short (max_tokens) keeps the
    arguments it got. So do Llama 3's once the reply's first name is one of the
    tools; else they come whole, once its reply ends."""

    plan: ToolPlan
    buffer: str = ""
    calls: list[dict] = field(default_factory=list)
    # named: the call's arguments stream as they come, after a first delta with the name.
    started: bool = False
    # required: where the next array item starts in ``buffer``; required, Hermes and
    # Mistral: the call being read.
    scan_pos: int = 0
    item: Optional[_CallReader] = None
    # Mistral: past the first [TOOL_CALLS]; Llama 3: the reply is calls, streamed.
    in_calls: bool = False
    # Mistral: its calls a JSON list (v3) or not (v11).
    listed: Optional[bool] = None
    # auto, llama3_json: the reply is text (it did not start with a call), or held to
    # its end (its first name is none of the tools).
    is_text: bool = False
    held: bool = False

    def push(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.mode == "named":
            return "", self._named(text)
        self.buffer += text
        if self.plan.mode == "required":
            return "", self._array_calls()
        return self._auto(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        if self.plan.mode == "auto":
            return self._auto(final=True)
        if self.plan.mode == "required" and not self.calls:
            return self.buffer, []  # a forced call that did not complete (max_tokens)
        return "", []

    def _named(self, text: str) -> list[dict]:
        if not self.started:
            self.started = True
            call = new_call(0, self.plan.name, text)
            self.calls.append(call)
            return [{**call, "function": dict(call["function"])}]  # calls[0] grows on
        self.calls[0]["function"]["arguments"] += text
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _array_calls(self, between: str = " \t\r\n[,") -> list[dict]:
        """What the array text so far adds to its calls: a call once its name is whole
        (the grammar writes it first), then its arguments' text as it comes. (Llama 3's
        calls, separated by ``between`` ";", are read so too.)"""
        out: list[dict] = []
        text = self.buffer
        while True:
            if self.item is None:
                pos = self.scan_pos
                while pos < len(text) and text[pos] in between:
                    pos += 1
                self.scan_pos = pos
                if pos == len(text) or text[pos] != "{":
                    return out
                self.item = _CallReader(pos)
            item = self.item
            item.read(text)
            self._grow(item, text, out)
            if item.end < 0:
                return out
            self.scan_pos, self.item = item.end, None

    def _auto(self, final: bool) -> tuple[str, list[dict]]:
        syntax = self.plan.syntax
        return (self._hermes(final) if syntax == "hermes" else
                self._tagged(final) if syntax in ("mistral", "granite")
                else self._llama3_json(final))

    def _tagged(self, final: bool) -> tuple[str, list[dict]]:
        """Text before the tag ([TOOL_CALLS], <|tool_call|>) flows; from it on the reply
        is calls, each streamed once its name is whole: a JSON list of {"name",
        "arguments"} after the tag (Mistral's v3 tokenizers, Granite; read as
        "required"'s), or Mistral's name[ARGS]{arguments} after each tag (v11 on). A
        reply none of whose calls began is text, at its end."""
        text, tag = "", self.plan.tag
        if not self.in_calls:
            start = self.buffer.find(tag)
            if start == -1:
                keep = 0 if final else partial_suffix(self.buffer, [tag])
                cut = len(self.buffer) - keep
                text, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return text, []
            text, self.buffer, self.in_calls = self.buffer[:start], self.buffer[start:], True
        out: list[dict] = []
        if self.listed:
            out = self._array_calls()
        else:
            self._mistral_named_calls(out)
        if final:
            if not self.calls:
                text += self.buffer
            self.buffer, self.item = "", None
        return text, out

    def _mistral_named_calls(self, out: list[dict]) -> None:
        """Mistral's calls from ``scan_pos`` on: each [TOOL_CALLS] then name[ARGS] and
        its arguments' object (or, after the first tag, a JSON list: self.listed)."""
        text = self.buffer
        while True:
            item = self.item
            if item is not None:
                item.read(text)
                self._grow(item, text, out)
                if item.end < 0:
                    return
                self.scan_pos, self.item = item.end, None
            pos = _skip_space(text, self.scan_pos)
            tag = self.plan.tag
            if not text.startswith(tag, pos):
                return  # the next tag has not come (or what follows the calls: dropped)
            pos = _skip_space(text, pos + len(tag))
            if pos == len(text):
                return
            if self.listed is None:
                self.listed = text[pos] in "[{"
                if self.listed:
                    self.scan_pos = pos
                    out += self._array_calls()
                    return
            args = text.find(MISTRAL_ARGS, pos)
            value = _skip_space(text, args + len(MISTRAL_ARGS)) if args != -1 else -1
            if args == -1 or value == len(text) or not text[pos:args].strip():
                return  # the name or the arguments have not begun (or no name: text)
            if text[value] != "{":
                return
            self.item = _CallReader(value, name=text[pos:args].strip(), args_start=value,
                                    arguments_only=True)

    def _llama3_json(self, final: bool) -> tuple[str, list[dict]]:
        if self.held and not final:
            return "", []  # its first name is none of the tools: held until it ends
        if not (self.in_calls or self.is_text or self.held):
            self._llama3_named()
        if self.in_calls:
            out = self._array_calls(between=" \t\r\n;")
            text = ""
            if final:  # what follows the calls (or a call cut short keeps what it got)
                text = "" if self.item is not None else self.buffer[self.scan_pos:].strip()
                self.buffer, self.item = "", None
            return text, out
        head = self.buffer[_llama3_start(self.buffer):]
        if not self.is_text and (head.startswith("{") or PYTHON_TAG.startswith(head)):
            if not final:
                return "", []  # a call may be coming: held until the reply ends
            calls = _parse_llama3(head, len(self.calls))
            if calls is not None:
                self.buffer = ""
                self.calls += calls
                return "", calls
        self.is_text = True
        text, self.buffer = self.buffer, ""
        return text, []

    def _llama3_named(self) -> None:
        """Whether a reply that starts with "{" is calls: yes (in_calls) once its first
        name is whole and one of the tools; held to its end once it is another, or the
        object ended without one."""
        if self.item is None:
            start = _llama3_start(self.buffer)
            if not self.buffer.startswith("{", start):
                return
            if not self.plan.tool_names:
                self.held = True
                return
            self.item = _CallReader(start)
        self.item.read(self.buffer)
        if self.item.name in self.plan.tool_names:
            self.in_calls = True
        elif self.item.name is not None or self.item.end >= 0:
            self.held, self.item = True, None

    def _grow(self, item: _CallReader, text: str, out: list[dict]) -> None:
        """Into ``out``, what ``item`` adds now: its call, once its name is whole (the
        models and the grammar write it first; arguments before it wait for it), then
        its arguments' new text (arguments given as a JSON string: its value, once
        whole)."""
        if item.name is None:
            return
        if item.call is None:
            item.call = new_call(len(self.calls), item.name, "")
            if self.plan.syntax == "mistral":   # the only ids its templates take back
                item.call["id"] = uuid.uuid4().hex[:9]
            self.calls.append(item.call)
            out.append({**item.call, "function": dict(item.call["function"])})
        if item.args_start < 0:
            return
        if text[item.args_start] == '"':
            if item.args_end < 0 or item.sent:
                return
            piece, item.sent = json.loads(text[item.args_start:item.args_end]), item.args_end
        else:
            upto = item.args_end if item.args_end >= 0 else len(text)
            piece = text[max(item.sent, item.args_start):upto]
            item.sent = upto
        if not piece:
            return
        item.call["function"]["arguments"] += piece
        if out and out[-1]["index"] == item.call["index"]:
            out[-1]["function"]["arguments"] += piece
        else:
            out.append({"index": item.call["index"], "function": {"arguments": piece}})

    def _hermes(self, final: bool) -> tuple[str, list[dict]]:
        """Text flows but what may begin <tool_call>; from it on, a JSON object's call
        streams once its name is whole. A body that is not such an object is held to
        </tool_call> and is a call if it parses as one, else text."""
        content: list[str] = []
        calls: list[dict] = []
        while True:
            if self.item is None:
                start = self.buffer.find(HERMES_START)
                if start == -1:
                    keep = 0 if final else partial_suffix(self.buffer, [HERMES_START])
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return "".join(content), calls
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                body = _skip_space(self.buffer, len(HERMES_START))
                if body < len(self.buffer) and self.buffer[body] == "{":
                    self.item = _CallReader(body)
                elif body == len(self.buffer) and not final:
                    return "".join(content), calls  # its body has not begun
                elif not self._hermes_whole(final, content, calls):
                    return "".join(content), calls
                continue
            item = self.item
            item.read(self.buffer)
            self._grow(item, self.buffer, calls)
            if item.call is None and (item.end >= 0 or final):
                self.item = None  # no name: held to its end, as any other body
                if not self._hermes_whole(final, content, calls):
                    return "".join(content), calls
                continue
            # Its object read (or cut short: the call keeps what it got), it ends at
            # </tool_call>, or at the next <tool_call> of a model that left it open.
            rest = self.buffer[item.end:] if item.end >= 0 else ""
            close, reopen = rest.find(HERMES_END), rest.find(HERMES_START)
            if reopen != -1 and (close == -1 or reopen < close):
                cut, skip = reopen, 0
            elif close != -1:
                cut, skip = close, len(HERMES_END)
            elif final:
                cut, skip = len(rest), 0
            else:
                return "".join(content), calls
            content.append(rest[:cut].strip())
            self.buffer, self.item = rest[cut + skip:], None

    def _hermes_whole(self, final: bool, content: list[str], calls: list[dict]) -> bool:
        """A Hermes call at the start of the buffer, read whole: a call if its body
        parses as one, else text (so is an unterminated one at the end). False while
        its end has not come."""
        end = self.buffer.find(HERMES_END)
        if end == -1:
            if final:
                content.append(self.buffer)
                self.buffer = ""
            return False
        body = self.buffer[len(HERMES_START):end]
        self.buffer = self.buffer[end + len(HERMES_END):]
        call = _parse_hermes(body, len(self.calls))
        if call is None:
            content.append(HERMES_START + body + HERMES_END)
        else:
            self.calls.append(call)
            calls.append(call)
        return True


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _llama3_start(text: str) -> int:
    """Where a Llama 3 reply's own text starts: past spaces and <|python_tag|>."""
    start = _skip_space(text, 0)
    if text.startswith(PYTHON_TAG, start):
        start = _skip_space(text, start + len(PYTHON_TAG))
    return start


def _parse_llama3(text: str, index: int) -> Optional[list[dict]]:
    """Llama 3's calls: JSON objects, separated by ';' or spaces; None unless the text
    is only calls."""
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = _call(item, index + len(calls))
        if call is None:
            return None
        calls.append(call)


def _call(item, index: int) -> Optional[dict]:
    """A parsed {"name", "arguments" or "parameters"} object as a call, or None."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return new_call(index, item["name"],
                    arguments if isinstance(arguments, str) else json.dumps(arguments))


def _parse_hermes(body: str, index: int) -> Optional[dict]:
    try:
        return _call(json.loads(body), index)
    except json.JSONDecodeError:
        return None
