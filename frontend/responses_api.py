"""OpenAI's Responses API (POST /v1/responses), served by the chat pipeline.

A Responses request is turned into a chat completion request (``ResponsesRequest.
to_chat``): ``instructions`` first as a system message, then ``input``, a text or a
list of items: messages, the function calls an assistant made (``function_call``)
and their results (``function_call_output``), as chat's assistant ``tool_calls`` and
``tool`` messages. It runs as any chat job, and ``ResponsesFormatter`` writes its
output in the Responses shapes: a ``response`` whose ``output`` holds the assistant's
text as a ``message`` of ``output_text`` and each call it made as a ``function_call``
item, with ``status`` ``completed``, or ``incomplete`` when ``max_output_tokens`` ran
out; streamed as OpenAI's typed events (``event:`` and ``data:`` lines, numbered), an
item added when its first text or call arrives and done when the next one starts or
the response ends; no ``[DONE]``.

Function tools are chat's, with the same ``tool_choice`` values (frontend/tools.py).
Nothing is stored, so ``store`` true, ``previous_response_id`` and ``background`` are
refused, as are built-in tools and reasoning settings: each a 400 naming its field.
``include`` takes the output text's logprobs (``top_logprobs`` alternatives each).
With ``--reasoning-parser`` a reasoning model's thinking comes first, as a
``reasoning`` item of ``reasoning_text`` (frontend/reasoning.py); reasoning items in
``input`` go to the template with the assistant's turn after them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

import msgspec
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError,
                      field_validator)

from common.sampling_params import MAX_TOP_LOGPROBS
from common.structured import StructuredOutput, json_schema_output
from common.tokenizer import TokenStrings
from frontend.choice import Delta
from frontend.errors import APIError
from frontend.job import Job
from frontend.openai_protocol import (ChatCompletionRequest, Count, FunctionDefinition,
                                      OpenAINoOpFields, Temperature, TopP, joined_text,
                                      text_parts_only)
from frontend.formatters import Formatter, chat_logprobs
from frontend.tools import ToolCallParser

_STRICT = ConfigDict(extra="forbid", strict=True)
_encode = msgspec.json.encode
LOGPROBS = "message.output_text.logprobs"


class TextPart(BaseModel):
    model_config = _STRICT
    # input_text in the client's turns, output_text in the assistant's earlier ones.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list] = None
    logprobs: Optional[list] = None


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        return text_parts_only(value, ("input_text", "output_text"))


class FunctionCallItem(BaseModel):
    """A call the assistant made earlier (as this server's output gave it)."""
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(BaseModel):
    """The result of one of those calls."""
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None


class ReasoningText(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's earlier thinking (as this server's output gave it): shown to
    the template with the assistant's turn that follows it."""
    model_config = _STRICT
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[None] = None
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


_ITEMS = {"message": TypeAdapter(MessageItem), "function_call": TypeAdapter(FunctionCallItem),
          "function_call_output": TypeAdapter(FunctionCallOutputItem),
          "reasoning": TypeAdapter(ReasoningItem)}
Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class FunctionTool(FunctionDefinition):
    """Chat's function, with its type beside it (not around it)."""
    type: Literal["function"]


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, min_length=1, max_length=64)
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextOptions(BaseModel):
    model_config = _STRICT
    format: TextFormat = TextFormat(type="text")
    verbosity: Optional[Literal["medium"]] = None


class ReasoningOptions(BaseModel):
    """OpenAI's reasoning settings: the effort (to the chat template, as chat's
    reasoning_effort); a summary is not made, so asking for one is refused."""
    model_config = _STRICT
    effort: Optional[Literal["minimal", "low", "medium", "high"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summary(cls, value):
        if value is not None:
            raise ValueError("not served: reasoning summaries are not made (with a "
                             "--reasoning-parser, the model's thinking comes whole as a "
                             "reasoning item)")
        return value


class ResponsesStreamOptions(BaseModel):
    model_config = _STRICT
    include_obfuscation: Optional[bool] = None  # no obfuscation is added either way


class ResponsesRequest(OpenAINoOpFields):
    stored: ClassVar[str] = "responses"
    model: Optional[str] = None
    input: Union[str, list[Item]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Count] = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    text: TextOptions = TextOptions()
    tools: Optional[list[FunctionTool]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: bool = True
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None
    # What needs storage or a reasoning model: refused unless empty.
    previous_response_id: Optional[str] = None
    background: Optional[bool] = None
    # Its effort reaches the chat template (chat's reasoning_effort); summaries are not
    # made
    reasoning: Optional[ReasoningOptions] = None
    # The one extra served: the output text's logprobs (with top_logprobs alternatives).
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: the prefix cache shares blocks only among requests with the same salt.
    cache_salt: Optional[str] = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_items(cls, value):
        # Here rather than by the union, whose first error would be "not a string".
        if not value or not isinstance(value, (str, list)):
            raise ValueError("input is empty; give a text or at least one message"
                             if value in ("", []) else
                             "input must be a text or a list of items")
        if isinstance(value, str):
            return value
        items = []
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in _ITEMS:
                raise ValueError(f"item {i} has type {kind!r}; the items served are "
                                 f"{', '.join(_ITEMS)}")
            try:
                items.append(_ITEMS[kind].validate_python(item))
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in (i, *first["loc"]))
                raise ValueError(f"item {where}: "
                                 f"{first['msg'].removeprefix('Value error, ')}") from None
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tool {i} has type {kind!r}; only function tools are served")
        return value

    @field_validator("include")
    @classmethod
    def _logprobs_only(cls, value):
        for kind in value or []:
            if kind != LOGPROBS:
                raise ValueError(f"{kind!r} is not served; only {LOGPROBS!r} may be included")
        return value

    @field_validator("previous_response_id", "background")
    @classmethod
    def _needs_what_is_not_here(cls, value, info):
        why = {"previous_response_id": "no response is stored; send the conversation as input",
               "background": "responses are not run in the background"}[info.field_name]
        if value:
            raise ValueError(f"not served: {why}")
        return value

    def to_chat(self) -> "ResponsesChat":
        """The chat completion request that computes this response. Raises APIError,
        or ValidationError for messages chat refuses."""
        messages: list[dict] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) \
            else self.input
        thinking = None  # a reasoning item's, for the assistant's turn after it
        for item in items:
            if isinstance(item, ReasoningItem):
                thinking = (thinking or "") + item.text()
                continue
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": joined_text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and thinking is None:
                    last.setdefault("tool_calls", []).append(call)  # one turn, several calls
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": joined_text(item.output)})
            if messages[-1]["role"] == "assistant" and thinking is not None:
                messages[-1]["reasoning_content"] = thinking
            thinking = None  # thinking before anything but the assistant's turn: dropped
        choice = self.tool_choice
        if not self.tools and choice in ("auto", "none"):
            choice = None  # no tools: nothing to choose (chat would ask for tools)
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        logprobs = LOGPROBS in (self.include or [])
        sampling = {key: getattr(self, key) for key in ("temperature", "top_p")
                    if key in self.model_fields_set}   # the rest: the server's defaults
        chat = ResponsesChat(
            logprobs=logprobs, top_logprobs=(self.top_logprobs or 0) if logprobs else None,
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            **sampling, stream=self.stream, user=self.user,
            tools=None if not self.tools else [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools],
            tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls,
            cache_salt=self.cache_salt,
            reasoning_effort=None if self.reasoning is None else self.reasoning.effort)
        chat._format = self.structured_output()
        return chat

    def structured_output(self) -> Optional[StructuredOutput]:
        fmt = self.text.format
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutput(kind="json_object", param="text.format")
        if fmt.schema_ is None or fmt.name is None:
            raise APIError(400, "text.format of type json_schema needs a name and a schema",
                           param="text.format", code="invalid_value")
        return json_schema_output(fmt.schema_, "text.format.schema")


class ResponsesChat(ChatCompletionRequest):
    """A chat request made from a Responses request: its output constraint keeps the
    Responses field's name (text.format) in errors."""

    _format: Optional[StructuredOutput] = PrivateAttr(None)

    def structured_output(self) -> Optional[StructuredOutput]:
        return self._format


class ResponsesFormatter(Formatter):
    """The response object, and its stream of typed events, for one chat choice. The
    same steps build both: the choice's text goes through the tool-call parser (when
    calls can be made) into output items, each opened, grown and closed, with an
    event for each step (a full response keeps only the items)."""

    def __init__(self, job: Job, strings: TokenStrings, request: ResponsesRequest) -> None:
        super().__init__(job, strings)
        self.request = request
        self.hex = job.request_id.removeprefix("resp_")
        self.parser = None if job.tool_plan is None else ToolCallParser(job.tool_plan)
        self.thinker = None if job.reasoning is None else job.reasoning.parser(
            job.thinks_first[0], calls=self.parser is not None)
        self.sequence = 0
        self.output: list[dict] = []
        self.open: Optional[dict] = None  # the item still growing, the last of output
        # include logprobs: those of tokens whose text has not gone out yet.
        self.logprobs: list[dict] = []

    def _take_logprobs(self, entries) -> None:
        if self.job.num_logprobs is not None:
            self.logprobs += chat_logprobs(entries, self.strings)["content"]

    def event(self, body: dict) -> bytes:
        body["sequence_number"] = self.sequence
        self.sequence += 1
        return b"event: " + body["type"].encode() + b"\ndata: " + _encode(body) + b"\n\n"

    # -- output items ---------------------------------------------------------------

    def _new_item(self, kind: str, item: dict) -> list[bytes]:
        """Close the open item, open this one (empty): the events."""
        out = self._close("completed")
        index = len(self.output)
        item = {"id": f"{kind}_{self.hex}" + (f"_{index}" if index else ""), **item}
        self.output.append(item)
        self.open = item
        out.append(self.event({"type": "response.output_item.added", "output_index": index,
                               "item": item}))
        return out

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _grow(self, kind: str, text: str) -> list[bytes]:
        """More text for the open "message" (its output_text) or "reasoning" item (its
        reasoning_text), opened with its part when another item is open: the events."""
        message = kind == "message"
        new_part = _part if message else _thinking
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self._new_item("msg", {"type": "message", "status": "in_progress",
                                          "role": "assistant", "content": []}) if message \
                else self._new_item("rs", {"type": "reasoning", "status": "in_progress",
                                           "summary": [], "content": []})
            out.append(self.event({"type": "response.content_part.added", **self._where(),
                                   "content_index": 0, "part": new_part("")}))
        assert self.open is not None
        if not self.open["content"]:
            self.open["content"].append(new_part(""))
        part = self.open["content"][0]
        part["text"] += text
        delta = {"type": "response.output_text.delta" if message else
                 "response.reasoning_text.delta", **self._where(), "content_index": 0,
                 "delta": text}
        if message:  # include's logprobs are the output text's
            part["logprobs"] += self.logprobs
            delta["logprobs"] = self.logprobs
        self.logprobs = []
        out.append(self.event(delta))
        return out

    def _on_call(self, call: dict) -> list[bytes]:
        out: list[bytes] = []
        if "id" in call:  # a new call (later pieces of a named call carry only arguments)
            out += self._new_item("fc", {"type": "function_call", "status": "in_progress",
                                         "call_id": call["id"],
                                         "name": call["function"]["name"], "arguments": ""})
        arguments = call["function"].get("arguments", "")
        if arguments:
            assert self.open is not None
            self.open["arguments"] += arguments
            out.append(self.event({"type": "response.function_call_arguments.delta",
                                   **self._where(), "delta": arguments}))
        return out

    def _close(self, status: str) -> list[bytes]:
        """Close the open item, if any: the events."""
        if self.open is None:
            return []
        item, where, self.open = self.open, self._where(), None
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self.logprobs  # of tokens held back, then no text
            self.logprobs = []
            out = [self.event({"type": "response.output_text.done", **where,
                               "content_index": 0, "text": part["text"],
                               "logprobs": part["logprobs"]}),
                   self.event({"type": "response.content_part.done", **where,
                               "content_index": 0, "part": part})]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out = [self.event({"type": "response.reasoning_text.done", **where,
                               "content_index": 0, "text": part["text"]}),
                   self.event({"type": "response.content_part.done", **where,
                               "content_index": 0, "part": part})]
        else:
            out = [self.event({"type": "response.function_call_arguments.done", **where,
                               "name": item["name"], "arguments": item["arguments"]})]
        return out + [self.event({"type": "response.output_item.done",
                                  "output_index": where["output_index"], "item": item})]

    def _consume(self, text: str, final: bool) -> list[bytes]:
        """Events for more of the choice's text (and, when ``final``, its end)."""
        calls: list[dict] = []
        out: list[bytes] = []
        if self.thinker is not None:
            thinking, text = self.thinker.take(text, final)
            if thinking:
                out += self._grow("reasoning", thinking)
        if self.parser is not None:
            text, calls = self.parser.take(text, final)
        if text:
            out += self._grow("message", text)
        for call in calls:
            out += self._on_call(call)
        if final:
            if not self.output or self.output[-1]["type"] == "reasoning":
                # no answer: an empty message, as OpenAI shows it
                out += self._grow("message", "")
            out += self._close(self._status())
        return out

    # -- the response ---------------------------------------------------------------

    def _status(self) -> str:
        return "incomplete" if self.job.choices[0].finish_reason == "length" else "completed"

    def response(self, status: str, usage: Optional[dict] = None,
                 error: Optional[APIError] = None) -> dict:
        r, job = self.request, self.job
        body = {
            "id": job.request_id, "object": "response", "created_at": job.created,
            "status": status, "model": job.model, "output": self.output,
            "error": None if error is None else {"code": error.code or "server_error",
                                                 "message": error.message},
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature, "top_p": r.top_p,
            "parallel_tool_calls": r.parallel_tool_calls,
            "tool_choice": (r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel)
                            else r.tool_choice or ("auto" if r.tools else "none")),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "previous_response_id": None, "reasoning": None, "store": False,
            "truncation": "disabled",
            "text": {"format": r.text.format.model_dump(by_alias=True, exclude_none=True)},
            "metadata": r.metadata or {}, "user": r.user, "usage": usage}
        if usage is not None:
            body["timing"] = job.timing()
        return body

    def _usage(self) -> dict:
        u = self.job.usage()
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": u["prompt_tokens_details"],
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": u.get("completion_tokens_details",
                                               {"reasoning_tokens": 0}),
                "total_tokens": u["total_tokens"]}

    def full(self) -> dict:
        self._take_logprobs(self.job.choices[0].logprobs)
        self._consume("".join(self.job.choices[0].text), final=True)
        return self.response(self._status(), self._usage())

    # -- a stream -------------------------------------------------------------------

    def first_chunks(self) -> list[dict]:
        created = self.response("in_progress")
        return [{"type": "response.created", "response": created},
                {"type": "response.in_progress", "response": created}]

    def stream_delta(self, delta: Delta, last: bool) -> list[bytes]:
        # The end is stream_end's: this is the text before it.
        self._take_logprobs(delta.logprobs)
        return self._consume(delta.text, final=False) if delta.text else []

    def stream_end(self) -> list[bytes]:
        out = self._consume("", final=True)
        status = self._status()
        return out + [self.event({"type": f"response.{status}",
                                  "response": self.response(status, self._usage())})]

    def stream_error(self, error: APIError) -> list[bytes]:
        return [self.event({"type": "error", "code": error.code, "message": error.message,
                            "param": error.param}),
                self.event({"type": "response.failed",
                            "response": self.response("failed", error=error)})]


def _thinking(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
