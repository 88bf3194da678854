"""gpt-oss's harmony format: a reply as a run of messages on channels.

A gpt-oss prompt ends with ``<|start|>assistant``; the reply is messages, each a
header, ``<|message|>``, its body and an end::

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

Its chat is served as a reasoning model's (``--reasoning-parser gpt_oss``, chosen by
itself for a model whose chat template writes harmony): the analysis channel is the
thinking (``reasoning_content``), the final channel and commentary meant for the user
the answer (``content``), and a message to a function (``to=functions.NAME``, in its
header before or after the channel) a tool call, where the request has tools (else,
as any message to a recipient, it goes with the thinking). The parser hands a call on to the
tool-call parser in Hermes' tags (``<tool_call>{"name": ..., "arguments": BODY}
</tool_call>``), so a call streams as a Hermes model's does. The reply's text keeps
its special tokens for the parser; no tag reaches a reply.

A structured output (or a forced tool call) constrains the final channel's body: the
engine holds the grammar back until ``<|channel|>final<|message|>`` (its token ids)
has been generated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from frontend.detokenizer import StreamSplitter, partial_suffix

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
# What ends a message's body (<|call|> and <|return|> are also the model's stop tokens)
BODY_ENDS = (END, CALL, RETURN, START)
FINAL_HEADER = CHANNEL + "final" + MESSAGE
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def is_harmony(template: Optional[str]) -> bool:
    """Whether a chat template writes harmony (gpt-oss's)."""
    return bool(template) and CHANNEL in template and MESSAGE in template


def _find(ids: list[int], part: tuple[int, ...], start: int) -> int:
    """Where the first occurrence of ``part`` in ``ids`` from ``start`` on starts, -1
    if none."""
    part = list(part)
    for i in range(start, len(ids) - len(part) + 1):
        if ids[i] == part[0] and ids[i:i + len(part)] == part:
            return i
    return -1


@dataclass(frozen=True)
class Harmony:
    """The harmony parser resolved against the model's tokenizer (the same methods as
    frontend.reasoning.Reasoning)."""

    name: str
    # <|channel|>final<|message|>: where the answer starts
    answer_after: tuple[int, ...]
    # <|channel|>analysis<|message|>: where thinking starts; <|end|>
    analysis: tuple[int, ...]
    end_id: int
    keeps_special_tokens = True

    @classmethod
    def resolve(cls, name: str, tokenizer) -> "Harmony":
        ids = {}
        for tag in (START, CHANNEL, MESSAGE, END):
            ids[tag] = tokenizer.token_to_id(tag)
            if ids[tag] is None:
                raise ValueError(f"reasoning parser {name}: the model's tokenizer has no {tag} "
                                 f"token; the parser is for gpt-oss's harmony format")
        def header(channel: str) -> tuple[int, ...]:
            words = tokenizer.encode(channel, add_special_tokens=False).ids
            return (ids[CHANNEL], *words, ids[MESSAGE])

        return cls(name, header("final"), header("analysis"), ids[END])

    def thinking_at_start(self, prompt_ids: list[int]) -> bool:
        """Whether the reply starts at a message's header (as after
        ``<|start|>assistant``) rather than inside the final channel's body."""
        return not prompt_ids[-len(self.answer_after):] == list(self.answer_after)

    @staticmethod
    def parser(thinking: bool, calls: bool = False) -> "HarmonyParser":
        """``calls``: whether the request may make tool calls (else a message to a
        recipient is the model's own business, and goes with its thinking)."""
        if thinking:
            return HarmonyParser(calls=calls)
        return HarmonyParser(calls=calls, in_header=False, channel="final")

    def num_tokens(self, thinking: bool, output_ids: list[int]) -> int:
        """The tokens of the reply's analysis messages, each from its <|channel|> to
        its <|end|> (or the reply's end); none where the reply starts in the answer."""
        count, at = 0, 0
        while thinking:
            at = _find(output_ids, self.analysis, at)
            if at == -1:
                break
            try:
                end = output_ids.index(self.end_id, at) + 1
            except ValueError:
                end = len(output_ids)
            count, at = count + end - at, end
        return count


@dataclass
class HarmonyParser(StreamSplitter):
    """One choice's harmony text split into (thinking, answer) as it streams, calls
    to functions written into the answer in Hermes' tags. ``push``, ``take`` and
    ``finish`` as frontend.reasoning.ReasoningParser's."""

    # whether messages to functions are handed on as calls (the request has tools)
    calls: bool = True
    in_header: bool = True
    header: str = ""
    channel: str = ""
    recipient: Optional[str] = None
    held: str = ""
    thought: bool = False

    def push(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning, content = "", ""
        while text:
            if self.in_header:
                self.header += text
                text = ""
                at = self.header.find(MESSAGE)
                if at == -1:
                    break
                text = self.header[at + len(MESSAGE):]
                content += self._open(self.header[:at])
                continue
            end = min((i for i in (text.find(tag) for tag in BODY_ENDS) if i != -1),
                      default=-1)
            body = text if end == -1 else text[:end]
            if end == -1:   # hold what may be the start of an end tag
                keep = partial_suffix(text, BODY_ENDS)
                body, self.held = text[:len(text) - keep], text[len(text) - keep:]
            more, answer = self._body(body)
            reasoning, content = reasoning + more, content + answer
            if end == -1:
                break
            content += self._close()
            # a new message: its header starts after the end tag (at <|start|>, with it)
            tag = next(t for t in BODY_ENDS if text.startswith(t, end))
            text = text[end + (0 if tag == START else len(tag)):]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held at the end: a body's last characters (a header cut short
        shows nothing; a call cut short keeps the arguments it got, unclosed)."""
        text, self.held = self.held, ""
        return ("", "") if self.in_header else self._body(text)

    def _open(self, header: str) -> str:
        """A message's header read: its channel and recipient."""
        self.in_header, self.header = False, ""
        found = _RECIPIENT.search(header)
        self.recipient = found.group(1) if found else None
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self.channel = channel.split(CONSTRAIN)[0].split()[0] if channel.split() else ""
        if self.recipient is None or not self.calls:
            return ""
        name = self.recipient.removeprefix("functions.")
        return '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": '

    def _body(self, text: str) -> tuple[str, str]:
        if (self.recipient is None and self.channel == "analysis") or (
                self.recipient is not None and not self.calls):
            self.thought = self.thought or bool(text)
            return text, ""
        return "", text

    def _close(self) -> str:
        """A message's end: the call's tags closed."""
        closing = "}</tool_call>" if self.recipient is not None and self.calls else ""
        self.in_header, self.header, self.channel, self.recipient = True, "", "", None
        return closing
