"""Turning one batch of tokenize requests into token ids. Pure: no sockets.

Chat messages are rendered with the model's chat template; plain prompts are taken
as they are. A text longer than the character limit is refused before encoding; the
rest of the batch is encoded in one call to the Rust tokenizer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Union

from common.protocol import ChatMessage, TokenizeError, TokenizeRequest, TokenizeResult
from common.tokenizer import fill_in_the_middle, load_tokenizer

Reply = Union[TokenizeResult, TokenizeError]


class PromptTokenizer:
    def __init__(self, model_dir: Path, max_chars: int,
                 chat_template: Optional[str] = None) -> None:
        """``chat_template``: one to use instead of the model's (--chat-template)."""
        self.tokenizer = load_tokenizer(model_dir)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.backend = self.tokenizer.backend_tokenizer
        self.fim = fill_in_the_middle(self.backend)
        self.max_chars = max_chars

    def render(self, request: TokenizeRequest) -> str:
        """The text to encode. Raises ValueError with a message for the user."""
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        if request.suffix is not None:
            if request.prompt is None or self.fim is None:
                raise ValueError("a suffix needs a text prompt and a model with "
                                 "fill-in-the-middle tokens")
            return self.fim(request.prompt, request.suffix)
        if request.prompt is not None:
            return request.prompt
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        template = self.tokenizer.chat_template
        messages = [_template_message(m, "tool_calls" in template) for m in request.messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=request.tools, tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                **request.template_kwargs)
        except Exception as e:  # jinja raises for what the template rejects
            raise ValueError(f"the chat template rejected these messages: {e}") from None

    def tokenize(self, requests: list[TokenizeRequest]) -> list[Reply]:
        """One reply per request, in order."""
        start = time.perf_counter()
        replies: list[Reply] = [None] * len(requests)  # type: ignore[list-item]
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        for i, request in enumerate(requests):
            try:
                text = self.render(request)
            except ValueError as e:
                replies[i] = TokenizeError(request_id=request.request_id, message=str(e))
                continue
            if len(text) > self.max_chars:
                replies[i] = TokenizeError(
                    request_id=request.request_id,
                    message=f"the prompt has {len(text)} characters, more than the limit "
                            f"of {self.max_chars}; it cannot fit the model's context")
                continue
            special = request.add_special_tokens
            if special is None:  # a rendered chat template holds its special tokens
                special = request.messages is None
            texts[special].append((i, text))
        for special, items in texts.items():
            if not items:
                continue
            encodings = self.backend.encode_batch([text for _, text in items],
                                                  add_special_tokens=special)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            for (i, _), encoding in zip(items, encodings):
                replies[i] = TokenizeResult(request_id=requests[i].request_id,
                                            prompt_token_ids=encoding.ids,
                                            tokenize_ms=elapsed_ms)
        return replies


def _template_message(message: ChatMessage, template_shows_calls: bool) -> dict:
    """A message as chat templates expect it: an assistant's earlier thinking as
    reasoning_content (Qwen3's name) and as thinking (gpt-oss's). An assistant's tool
    calls go to a template that renders them with their arguments as a dict (as
    Hugging Face templates read them); a template that does not render them sees them
    as JSON text in the message's content, so that no call is silently dropped."""
    out = {k: v for k, v in (("role", message.role), ("content", message.content),
                             ("name", message.name), ("tool_call_id", message.tool_call_id),
                             ("reasoning_content", message.reasoning_content),
                             ("thinking", message.reasoning_content))   # gpt-oss's name
           if v is not None}
    if not message.tool_calls:
        return out
    calls = []
    for call in message.tool_calls:
        function = dict(call.get("function") or {})
        try:
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            pass  # kept as the text the client sent
        calls.append({**call, "function": function})
    if template_shows_calls:
        out["tool_calls"] = calls
    else:
        shown = json.dumps([{"name": c["function"].get("name"),
                             "arguments": c["function"].get("arguments")} for c in calls])
        out["content"] = f"{message.content}\n{shown}" if message.content else shown
    return out
