"""A reasoning model's thinking, told apart from its answer (``--reasoning-parser``).

DeepSeek-R1 (and its Llama and Qwen distillations), QwQ and Qwen3 write their thinking
between ``<think>`` and ``</think>``, then the answer. With a parser named, a chat
reply's thinking goes to ``reasoning_content`` and only the answer to ``content``
(where tool calls are looked for), as it is generated.

Where a reply starts is read from its prompt, whose last tag decides: an open
``<think>`` (a template that opens the thinking for the model, or a continued message
inside it) starts it in the thinking, a ``</think>`` (Qwen3 with ``enable_thinking``
false, or a continued message past it) in the answer. A prompt with neither starts
where the parser says: ``deepseek_r1`` in the thinking (R1's replies may begin
without the tag), ``qwen3`` in the answer, unless the reply opens with ``<think>``.

Both tags must be single tokens of the model's vocabulary: the engine holds a
structured output's grammar back until the thinking ends (SamplingParams.
structured_after), which it sees as the end tag's token id.

``gpt_oss`` is gpt-oss's harmony format (frontend/harmony.py), where channels, not
tags, tell the thinking from the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from frontend.detokenizer import StreamSplitter, partial_suffix
from frontend.harmony import Harmony

START, END = "<think>", "</think>"
# Parser name -> whether a prompt without tags starts the reply in the thinking.
PARSERS = {"deepseek_r1": True, "qwen3": False, "gpt_oss": True}


def _rindex(ids: list[int], token_id: int) -> int:
    """The last position of ``token_id`` in ``ids``, -1 if absent (at C speed)."""
    try:
        return len(ids) - 1 - ids[::-1].index(token_id)
    except ValueError:
        return -1


@dataclass(frozen=True)
class Reasoning:
    """A parser resolved against the model's tokenizer."""

    name: str
    start_id: int
    end_id: int
    thinks_first: bool
    # Whether the reply's text keeps its special tokens for the parser (harmony's)
    keeps_special_tokens = False

    @property
    def answer_after(self) -> tuple[int, ...]:
        """The token ids that end the thinking: a structured output's grammar applies
        after them."""
        return (self.end_id,)

    @classmethod
    def resolve(cls, name: str, tokenizer) -> "ReasoningFormat":
        """Raises ValueError naming what the tokenizer lacks."""
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
        if name == "gpt_oss":
            return Harmony.resolve(name, tokenizer)
        ids = []
        for tag in (START, END):
            token_id = tokenizer.token_to_id(tag)
            if token_id is None:
                raise ValueError(f"reasoning parser {name}: the model's tokenizer has no "
                                 f"{tag} token; the parser is for models that think between "
                                 f"{START} and {END} tokens")
            ids.append(token_id)
        return cls(name, ids[0], ids[1], PARSERS[name])

    def thinking_at_start(self, prompt_ids: list[int]) -> bool:
        start, end = _rindex(prompt_ids, self.start_id), _rindex(prompt_ids, self.end_id)
        if start == end:  # neither
            return self.thinks_first
        return start > end

    @staticmethod
    def parser(thinking: bool, calls: bool = False) -> "ReasoningParser":
        """A parser for a reply that starts in its thinking or not (thinking_at_start
        of its prompt, worked out once per choice: Job.thinks_first). ``calls``:
        whether the request may make tool calls (harmony's parser's concern)."""
        return ReasoningParser(thinking=thinking, fresh=not thinking, strip=thinking)

    def num_tokens(self, thinking: bool, output_ids: list[int]) -> int:
        """How many of a reply's tokens are its thinking (the tags included), for a
        reply that starts in its thinking or not (Job.thinks_first)."""
        if thinking:
            begin = 0
        elif self.start_id in output_ids[:8]:  # a reply that opens its thinking
            begin = output_ids.index(self.start_id)
        else:
            return 0
        try:
            return output_ids.index(self.end_id, begin) + 1
        except ValueError:
            return len(output_ids)


# A parser resolved against the tokenizer: tags (<think>) or harmony's channels
ReasoningFormat = Union[Reasoning, Harmony]


@dataclass
class ReasoningParser(StreamSplitter):
    """One choice's text split into (thinking, answer) as it streams. ``push(text)``
    returns what each gained; ``finish()`` what was held at the end. Whitespace right
    after a tag is dropped; a partial tag is held until it is whole or is not one."""

    thinking: bool
    # Nothing of the reply shown yet: an opening <think> may still come.
    fresh: bool = True
    # Dropping whitespace at the start of the current part.
    strip: bool = False
    held: str = ""
    # The reply thought (for usage and for the Responses API's items).
    thought: bool = False

    def push(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning, content = "", ""
        while text:
            if self.thinking:
                self.thought = True
                end = text.find(END)
                if end == -1:
                    keep = partial_suffix(text, [END])
                    text, self.held = text[:len(text) - keep], text[len(text) - keep:]
                    reasoning += self._stripped(text)
                    break
                reasoning += self._stripped(text[:end])
                text = text[end + len(END):]
                self.thinking, self.fresh, self.strip = False, False, True
                continue
            if self.fresh:
                head = text.lstrip()
                if head.startswith(START):
                    text = head[len(START):]
                    self.thinking, self.fresh, self.strip = True, False, True
                    continue
                if START.startswith(head):  # maybe the tag, not whole yet
                    self.held = text
                    break
                self.fresh = False
            content += self._stripped(text)
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        text, self.held = self.held, ""
        if self.thinking:
            return self._stripped(text), ""
        return "", self._stripped(text)

    def _stripped(self, text: str) -> str:
        if self.strip:
            text = text.lstrip()
            self.strip = not text
        return text

