"""One engine request checked against the model it goes to, written once: the frontend
runs it (a 400 before any engine sees the request) and the engine runs it again (it
serves clients other than our frontend, and an engine of another model may answer).
"""

from __future__ import annotations

from typing import Sequence

from common.errors import InvalidRequestError
from common.protocol import SamplingParams


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context
    (OpenAI's code ``context_length_exceeded``)."""


def check_token_ids(token_ids: Sequence, vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if type(token_id) is not int or not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"{param} has token id {token_id!r} outside the "
                                      f"vocabulary [0, {vocab_size})", param)


def checked_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int,
                   max_model_len: int) -> list[int]:
    """The prompt as the engine will see it (truncated if asked), after checking the
    sampling parameters, every token id and the context length. Raises
    InvalidRequestError (ContextLengthError for the context) naming the field."""
    params.validate()
    prompt = list(prompt_token_ids)
    if params.truncate_prompt_tokens is not None:
        prompt = prompt[-params.truncate_prompt_tokens:]
    if not prompt:
        raise InvalidRequestError("the prompt is empty; it needs at least one token", "prompt")
    check_token_ids(prompt, vocab_size, "prompt")
    for name, ids in params.token_id_fields():
        check_token_ids(ids, vocab_size, name)
    n = len(prompt)
    if n >= max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {n} tokens, leaving no room to generate", "prompt")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {n} tokens and max_tokens is {params.max_tokens} "
            f"({n + params.max_tokens} in total)", "max_tokens")
    return prompt
