"""OpenAI's Responses API (POST /v1/responses), served by the chat pipeline.

A Responses request is turned into a chat completion request (``ResponsesRequest.
to_chat``: ``instructions`` first as a system message, then ``input``, a text or a list
of messages), run as any chat job, and its output written in the Responses shapes by
``ResponsesFormatter``: a ``response`` object whose ``output`` holds one assistant
message of ``output_text``, with ``status`` ``completed``, or ``incomplete`` when
``max_output_tokens`` ran out; streamed as OpenAI's typed events (``event:`` and
``data:`` lines: response.created ... response.output_text.delta ...
response.completed), without a ``[DONE]``.

Served: text in and out, ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, structured output (``text.format``), ``stream``. Nothing is stored, so
``store`` true, ``previous_response_id`` and ``background`` are refused, as are tools,
reasoning and ``include``: each a 400 naming its field. The chat endpoint serves tools.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError,
                      field_validator)

from common.structured import StructuredOutput, json_schema_output
from frontend.errors import APIError
from frontend.job import Job
from frontend.openai_protocol import (ChatCompletionRequest, Count, Metadata, Temperature,
                                      TopP)
from frontend.responses import Formatter, TokenText

_STRICT = ConfigDict(extra="forbid", strict=True)
_encode = msgspec.json.encode


class InputText(BaseModel):
    model_config = _STRICT
    # input_text in the client's turns, output_text in the assistant's earlier ones.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list] = None


class InputMessage(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        for i, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("input_text", "output_text"):
                raise ValueError(f"content part {i} has type {kind!r}; this model takes "
                                 f"text only (input_text, and output_text in an "
                                 f"assistant's turn)")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


_MESSAGES = TypeAdapter(list[InputMessage])


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


class ResponsesStreamOptions(BaseModel):
    model_config = _STRICT
    include_obfuscation: Optional[bool] = None  # no obfuscation is added either way


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str
    input: Union[str, list[InputMessage]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Count] = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    text: TextOptions = TextOptions()
    # Nothing is stored: false, or absent (then the response says store false).
    store: Optional[bool] = None
    metadata: Optional[Metadata] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[Literal["auto", "default"]] = None
    truncation: Optional[Literal["disabled"]] = None
    parallel_tool_calls: Optional[bool] = None
    # What needs storage, tools or a reasoning model: refused unless empty.
    previous_response_id: Optional[str] = None
    background: Optional[bool] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    reasoning: Optional[dict] = None
    include: Optional[list] = None

    _format: Optional[StructuredOutput] = PrivateAttr(None)

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_messages(cls, value):
        # Here rather than by the union, whose first error would be "not a string".
        if not value or not isinstance(value, (str, list)):
            raise ValueError("input is empty; give a text or at least one message"
                             if value in ("", []) else
                             "input must be a text or a list of messages")
        if isinstance(value, str):
            return value
        try:
            return _MESSAGES.validate_python(value)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"message {where}: "
                             f"{first['msg'].removeprefix('Value error, ')}") from None

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value):
        if value:
            raise ValueError("this server keeps no responses; send store false or leave it out")
        return value

    @field_validator("previous_response_id", "background", "reasoning")
    @classmethod
    def _needs_what_is_not_here(cls, value, info):
        why = {"previous_response_id": "no response is stored; send the conversation as input",
               "background": "responses are not run in the background",
               "reasoning": "this model does not reason"}[info.field_name]
        if value:
            raise ValueError(f"not served: {why}")
        return value

    @field_validator("tools", "tool_choice", "include")
    @classmethod
    def _not_on_this_endpoint(cls, value):
        if value and value not in ("none", "auto"):  # no tools: either choice is none
            raise ValueError("not served on /v1/responses (/v1/chat/completions serves "
                             "tools)")
        return value

    def to_chat(self) -> "ResponsesChat":
        """The chat completion request that computes this response. Raises APIError."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) \
            else self.input
        messages += [{"role": m.role, "content": m.text()} for m in items]
        chat = ResponsesChat(model=self.model, messages=messages,
                             max_completion_tokens=self.max_output_tokens,
                             temperature=self.temperature, top_p=self.top_p,
                             stream=self.stream, user=self.user)
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
    """The response object, and its stream of typed events, for one chat choice."""

    def __init__(self, job: Job, token_text: TokenText, request: ResponsesRequest) -> None:
        super().__init__(job, token_text)
        self.request = request
        self.item_id = "msg_" + job.request_id.removeprefix("resp_")
        self.sequence = 0

    def event(self, body: dict) -> bytes:
        body["sequence_number"] = self.sequence
        self.sequence += 1
        return b"event: " + body["type"].encode() + b"\ndata: " + _encode(body) + b"\n\n"

    def _text(self) -> str:
        return "".join(self.job.choices[0].text)

    def _status(self) -> str:
        return "incomplete" if self.job.choices[0].finish_reason == "length" else "completed"

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, content: list) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    def response(self, status: str, output: list, usage: Optional[dict] = None,
                 error: Optional[APIError] = None) -> dict:
        r, job = self.request, self.job
        return {
            "id": job.request_id, "object": "response", "created_at": job.created,
            "status": status, "model": job.model, "output": output,
            "error": None if error is None else {"code": error.code or "server_error",
                                                 "message": error.message},
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature, "top_p": r.top_p, "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "previous_response_id": None,
            "reasoning": None, "store": False, "truncation": "disabled",
            "text": {"format": r.text.format.model_dump(by_alias=True, exclude_none=True)},
            "metadata": r.metadata or {}, "user": r.user, "usage": usage,
            **({"timing": job.timing()} if usage is not None else {})}

    def _usage(self) -> dict:
        u = self.job.usage()
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": u["prompt_tokens_details"],
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def full(self) -> dict:
        status = self._status()
        return self.response(status, [self._item(status, [self._part(self._text())])],
                             self._usage())

    def first_chunks(self) -> list[dict]:
        created = self.response("in_progress", [])
        return [{"type": "response.created", "response": created},
                {"type": "response.in_progress", "response": created},
                {"type": "response.output_item.added", "output_index": 0,
                 "item": self._item("in_progress", [])},
                {"type": "response.content_part.added", "item_id": self.item_id,
                 "output_index": 0, "content_index": 0, "part": self._part("")}]

    def chunk(self, delta, last: bool) -> Optional[dict]:
        if not delta.text:
            return None
        return {"type": "response.output_text.delta", "item_id": self.item_id,
                "output_index": 0, "content_index": 0, "delta": delta.text, "logprobs": []}

    def stream_end(self) -> list[bytes]:
        text, status = self._text(), self._status()
        item = self._item(status, [self._part(text)])
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [self.event(body) for body in (
            {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": self._part(text)},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": f"response.{status}",
             "response": self.response(status, [item], self._usage())})]

    def stream_error(self, error: APIError) -> list[bytes]:
        return [self.event({"type": "error", "code": error.code, "message": error.message,
                            "param": error.param}),
                self.event({"type": "response.failed",
                            "response": self.response("failed", [], error=error)})]
