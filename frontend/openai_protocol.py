"""OpenAI-compatible request bodies (pydantic), validated at the HTTP boundary.

Fields OpenAI defines keep its names, defaults and ranges. Extensions vLLM users expect
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
return_token_ids, skip_special_tokens, truncate_prompt_tokens) sit beside them.
Unknown fields are rejected, so a typo is a 400 naming the field, not a silent
default; fields OpenAI defines that roseserve does not implement are rejected by name.
Types are strict (a string is not a number, a number not a boolean), and every integer
is bounded, so nothing a client sends can overflow further on (the wire protocol's
integers are 64-bit).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.protocol import (MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY,
                             SamplingParams)


# The largest count or id a client may send (token counts, top_k, token ids).
MAX_INT = 2**31 - 1
Count = Annotated[int, Field(ge=1, le=MAX_INT)]
# Token ids are checked against the vocabulary later, with a message saying so.
TokenId = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    user: Optional[str] = None
    # OpenAI fields roseserve does not implement: accepted only when unset or empty.
    logit_bias: Optional[dict[str, float]] = None
    # Extensions.
    top_k: Optional[Count] = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = []
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Optional[Count] = None

    @field_validator("logit_bias", "echo", "suffix", check_fields=False)
    @classmethod
    def _refuse_unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported")
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

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        choice_index: int) -> SamplingParams:
        # With n > 1 and a seed, each choice gets its own (seed + index): the same
        # seed would make every choice identical.
        seed = None if self.seed is None else self.seed + choice_index
        if seed is not None and seed >= 2**64:
            seed -= 2**64  # wraps, still distinct per choice
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=seed,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Optional[Count] = 16
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Not implemented: refused when set (see _refuse_unsupported).
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of is not supported (it may only equal n)")
        return value

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


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessageParam(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: Optional[Count] = None
    max_completion_tokens: Optional[Count] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None
