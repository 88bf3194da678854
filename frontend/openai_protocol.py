"""OpenAI-compatible request bodies (pydantic), validated at the HTTP boundary.

Fields OpenAI defines keep its names, defaults and ranges. Extensions vLLM users expect
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, allowed_token_ids, bad_words, guided_json, guided_regex,
guided_choice, guided_grammar, return_token_ids, skip_special_tokens,
truncate_prompt_tokens) sit beside them. Unknown fields are rejected, so a typo is a
400 naming the field, not a silent default; fields OpenAI defines that roseserve does
not implement are rejected by name.
Types are strict (a string is not a number, a number not a boolean), and every integer
is bounded, so nothing a client sends can overflow further on (the wire protocol's
integers are 64-bit).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from common.errors import InvalidRequestError
from common.sampling_params import (MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS,
                                   MIN_REPETITION_PENALTY, SamplingParams)
from common.structured import StructuredOutput, json_schema_output


# The largest count or id a client may send (token counts, top_k, token ids).
MAX_INT = 2**31 - 1
Count = Annotated[int, Field(ge=1, le=MAX_INT)]
# Token ids are checked against the vocabulary later, with a message saying so.
TokenId = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
_STRICT = ConfigDict(extra="forbid", strict=True)
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
# OpenAI's metadata: up to 16 pairs of strings (checked, then dropped: nothing is stored).
# Names a request's chat_template_kwargs may not use: apply_chat_template's own
# parameters (chat_template among them: a request brings no template of its own) and
# what the renderer itself puts in a template's context.
RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs", "bos_token", "eos_token", "unk_token",
    "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
    "raise_exception", "strftime_now"})


def _template_names(value: dict) -> dict:
    for name in value:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name):
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable "
                             f"name (letters, digits and _, up to 64)")
        if name in RESERVED_TEMPLATE_NAMES:
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the server, not "
                             f"by a request")
    return value


# Extra variables for the chat template (e.g. Qwen3's enable_thinking), vLLM's field.
TemplateKwargs = Annotated[dict[str, Any], Field(max_length=32),
                           AfterValidator(_template_names)]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=16)]
# At most this many bad words per request (each is banned as it is and after a space).
MAX_BAD_WORDS = 100


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def structured_output(self) -> Optional[StructuredOutput]:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(kind="json_object", param="response_format")
        if self.json_schema is None:
            raise InvalidRequestError("response_format of type json_schema needs a "
                                      "json_schema", "response_format.json_schema")
        return json_schema_output(self.json_schema.schema_ or {},
                                  "response_format.json_schema.schema")


class StructuredOutputsParam(BaseModel):
    """vLLM's structured_outputs (its guided_* fields' successor): one constraint, and
    for JSON how it is spaced. disable_fallback changes nothing (there is one backend);
    structural_tag is not served."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # JSON: no whitespace between tokens, or whitespace of this pattern only.
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None
    # Objects that list their properties allow no others here whatever it says;
    # false is refused (a schema allows others with additionalProperties).
    disable_additional_properties: Optional[bool] = None
    disable_fallback: bool = False

    @field_validator("disable_additional_properties")
    @classmethod
    def _closed_objects_only(cls, value):
        if value is False:
            raise ValueError("objects that list their properties allow no others here; to "
                             "allow them, give the object additionalProperties: true")
        return value

    def structured_output(self) -> StructuredOutput:
        """Raises InvalidRequestError unless exactly one constraint is given."""
        param = "structured_outputs"
        given = [key for key in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if key == "json" else key) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs must give exactly one of json, regex, choice, grammar "
                f"and json_object; it gives {', '.join(given) or 'none'}", param)
        kind = given[0]
        spacing = {}
        if self.disable_any_whitespace:
            spacing["whitespace_flexible"] = False
        if self.whitespace_pattern is not None:
            spacing["whitespace_pattern"] = self.whitespace_pattern
        if spacing and kind not in ("json", "json_object"):
            raise InvalidRequestError("disable_any_whitespace and whitespace_pattern apply to "
                                      "json and json_object only", param)
        if kind in ("json", "json_object"):
            return json_schema_output({"type": "object"} if kind == "json_object"
                                      else self.json_, f"{param}.{kind}", spacing)
        spec = {"regex": self.regex, "choice": json.dumps(self.choice),
                "grammar": self.grammar}[kind]
        return StructuredOutput(kind=kind, spec=spec, param=f"{param}.{kind}")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (include_usage adds the last one).
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


def joined_text(content) -> str:
    """A content's text: the string, or its text parts' texts one after the other."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class Prediction(BaseModel):
    """OpenAI's predicted output: text the reply is expected to mostly repeat."""

    model_config = _STRICT
    type: Literal["content"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return joined_text(self.content)


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: Optional[str] = None   # the first name served (vLLM's, llama.cpp's)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    user: Optional[str] = None
    # Token id (as a string, as OpenAI has it) -> bias added to its logit.
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None
    # Extensions.
    # vLLM's -1 and 0 (every token), as its clients send them, are no top-k.
    top_k: Optional[Annotated[int, Field(ge=-1, le=MAX_INT)]] = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    # vLLM's: lower is served first (the engine admits waiting requests in its order).
    priority: int = Field(0, ge=-MAX_INT, le=MAX_INT)
    # vLLM's: prefix-cache blocks are shared only among requests with the same salt
    # (checked by SamplingParams.validate).
    cache_salt: Optional[str] = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = []
    return_token_ids: bool = False
    # vLLM's: logprobs name tokens "token_id:N"; None: the server's
    # --return-tokens-as-token-ids.
    return_tokens_as_token_ids: Optional[bool] = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Optional[Count] = None
    include_stop_str_in_output: bool = False
    # vLLM's: logprobs of the prompt's tokens (and the N most likely at each).
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    allowed_token_ids: Optional[list[TokenId]] = Field(None, min_length=1)
    bad_words: list[str] = Field([], max_length=MAX_BAD_WORDS)
    # vLLM's structured output fields; at most one of them (or response_format).
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[StructuredOutputsParam] = None
    # OpenAI's: where the engine speculates (--speculative-tokens), the proposals come
    # from it; the output is the same either way.
    prediction: Optional[Prediction] = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value):
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def structured_output(self) -> Optional[StructuredOutput]:
        """The one output constraint asked for, if any. Raises InvalidRequestError."""
        given = []
        if self.response_format is not None:
            output = self.response_format.structured_output()
            if output is not None:
                given.append(output)
        if self.guided_json is not None:
            given.append(json_schema_output(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            given.append(StructuredOutput(kind="regex", spec=self.guided_regex,
                                          param="guided_regex"))
        if self.guided_choice is not None:
            given.append(StructuredOutput(kind="choice", spec=json.dumps(self.guided_choice),
                                          param="guided_choice"))
        if self.guided_grammar is not None:
            given.append(StructuredOutput(kind="grammar", spec=self.guided_grammar,
                                          param="guided_grammar"))
        if self.structured_outputs is not None:
            given.append(self.structured_outputs.structured_output())
        if len(given) > 1:
            first, second = (g.param.split(".")[0] for g in given[:2])
            raise InvalidRequestError(f"{first} and {second} both constrain the output; give "
                                      f"at most one", second)
        return given[0] if given else None

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        choice_index: int, **extra) -> SamplingParams:
        """``extra``: fields the frontend computes (structured, bad_words_ids)."""
        # With n > 1 and a seed, each choice gets its own (seed + index): the same
        # seed would make every choice identical.
        seed = None if self.seed is None else self.seed + choice_index
        if seed is not None and seed >= 2**64:
            seed -= 2**64  # wraps, still distinct per choice
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None,
            top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=seed,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            allowed_token_ids=self.allowed_token_ids, priority=self.priority,
            cache_salt=self.cache_salt,
            prompt_logprobs=extra.pop("prompt_logprobs", self.prompt_logprobs), **extra)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # The prompt's text before the completion's.
    echo: bool = False
    # 0 with echo: the prompt alone, scored (its logprobs with logprobs), as OpenAI's
    # completions took it; declared after echo, which its check reads.
    max_tokens: Optional[Annotated[int, Field(ge=0, le=MAX_INT)]] = 16
    # Generate best_of choices per prompt, return the n with the highest log
    # probability (not with stream).
    best_of: Optional[int] = Field(None, ge=1, le=64)
    # vLLM's: a text prompt is tokenized with the tokenizer's special tokens (e.g. BOS).
    add_special_tokens: bool = True
    # The text after the completion: a model with fill-in-the-middle tokens (code
    # models) writes what goes between the prompt and it. "" is none.
    suffix: Optional[str] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, value, info):
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"best_of ({value}) must be at least n ({n})")
        if value is not None and value > n and info.data.get("stream"):
            raise ValueError("best_of greater than n cannot be streamed (the best choices "
                             "are known only at the end)")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _nothing_generated_only_with_echo(cls, value, info):
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1; 0 is taken only with echo "
                             "(the prompt returned, scored with logprobs, nothing generated)")
        if value == 0 and info.data.get("min_tokens"):
            raise ValueError(f"min_tokens ({info.data['min_tokens']}) must not exceed "
                             f"max_tokens (0)")
        return value

    def num_generated(self) -> int:
        """Choices generated per prompt."""
        return max(self.best_of or 1, self.n)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]  # an empty list of token ids: the engine reports it empty
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ToolCallFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCallParam(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def text_parts_only(content, kinds: tuple[str, ...]):
    """A message's content, checked before its union is: a part of a kind other than
    ``kinds`` is named (the union's own error would say only that it is not a string)."""
    for i, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in kinds:
            raise ValueError(f"content part {i} has type {kind!r}; this model takes text "
                             f"only (parts of type {' or '.join(map(repr, kinds))})")
    return content


class ChatMessageParam(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    # An assistant's earlier calls, and a tool message's answer to one of them.
    tool_calls: Optional[list[ToolCallParam]] = None
    tool_call_id: Optional[str] = None
    # An assistant's earlier thinking, as a reasoning model's reply gave it
    # (reasoning_content; vLLM's newer name, reasoning): for templates that show it.
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        return text_parts_only(value, ("text",))

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        # OpenAI's rules: only an assistant's content may be absent, and only when it
        # calls tools; calls come from assistants, answers to them from tools.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a message of role {self.role!r} needs content"
                             + (" or tool_calls" if self.role == "assistant" else ""))
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"a message of role {self.role!r} has tool_calls; only an "
                             f"assistant's may")
        if (self.reasoning_content is not None or self.reasoning is not None) \
                and self.role != "assistant":
            raise ValueError(f"a message of role {self.role!r} has reasoning; only an "
                             f"assistant's may")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs the tool_call_id it answers"
                             if self.role == "tool" else
                             f"a message of role {self.role!r} has a tool_call_id; only a "
                             f"tool's may")
        return self

    def thinking(self) -> Optional[str]:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        return joined_text(self.content)


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolParam(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class OpenAINoOpFields(BaseModel):
    """OpenAI's fields that change nothing here (chat and /v1/responses), taken so
    that its clients' requests are served: nothing is stored (store true is refused),
    metadata is checked to OpenAI's limits and dropped, there is one service tier, and
    the router already follows the prompt's cached prefix (prompt_cache_key)."""

    model_config = _STRICT
    # What this endpoint would have stored, for store true's refusal.
    stored: ClassVar[str] = "completions"
    store: Optional[bool] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value):
        if value:
            raise ValueError(f"this server keeps no {cls.stored}; send store false or "
                             f"leave it out")
        return value

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, value):
        if value not in (None, "auto", "default"):
            raise ValueError(f"this server has one service tier; {value!r} is not it "
                             f"(send 'auto' or 'default', or leave it out)")
        return value


class ChatCompletionRequest(_SamplingFields, OpenAINoOpFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: Optional[Count] = None
    max_completion_tokens: Optional[Count] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's: the last message, an assistant's, is left open and the model goes on
    # with its text (frontend/input_processor.py: template_options).
    continue_final_message: bool = False
    tools: Optional[list[ToolParam]] = Field(None, max_length=128)
    # Default: "auto" when there are tools, "none" when there are none.
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    # The output is text.
    modalities: Optional[list[str]] = None
    # vLLM's: with --reasoning-parser, whether the reply's thinking is returned.
    include_reasoning: bool = True
    # OpenAI's: how much a reasoning model thinks, for a template that reads it as the
    # variable reasoning_effort (gpt-oss's); other templates leave it unread.
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None
    # vLLM's: the tokenizer's special tokens (e.g. BOS) added around the rendered chat,
    # on top of those its template wrote.
    add_special_tokens: bool = False

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, value):
        if value is not None and value != ["text"]:
            raise ValueError(f"this model's output is text only (modalities ['text']), "
                             f"got {value!r}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value):
        names = [tool.function.name for tool in value or []]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"two tools are named {duplicate!r}")
        return value

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_generated(self) -> int:
        return self.n


class TokenizeBody(BaseModel):
    """/tokenize (vLLM's shape): a prompt, or chat messages rendered by the template."""

    model_config = _STRICT
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessageParam]] = Field(None, min_length=1)
    # The tokenizer's special tokens (e.g. BOS) around the text; default: on for a
    # prompt, off for messages (their template writes them).
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[ToolParam]] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = _STRICT
    model: Optional[str] = None
    tokens: list[TokenId]
