"""Formatters: a job's OpenAI response body and stream events, built as plain dicts
(encoded with msgspec), one class per endpoint (completions and chat here; the
Responses API's in frontend/responses_api.py).

The per-request timing breakdown rides in an extension field, ``timing``:
tokenize_ms, queue_ms and prefill_ms (engine-side durations) and ttft_ms (as the
server saw it), on the non-streaming response and on the last chunk of a stream.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING, Callable, Optional

import msgspec

from common.protocol import TokenLogprobs
from common.tokenizer import TokenStrings
from frontend.choice import Delta
from frontend.job import Job
from frontend.tools import ToolCallParser

if TYPE_CHECKING:
    from frontend.errors import APIError

_encode = msgspec.json.encode
DONE = b"data: [DONE]\n\n"


def token_label(strings: TokenStrings, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or (vLLM's return_tokens_as_token_ids,
    for clients that need every token told apart, partial characters too)
    ``token_id:N``."""
    return (lambda t: f"token_id:{t}") if as_ids else strings.text


class TextOffsets:
    """Where each of a choice's tokens starts in its text, in characters, counted as
    the text is decoded: a character split across tokens counts once, from the token
    completing it (a token holding its first bytes starts where it will be), and
    special tokens the text leaves out count nothing."""

    def __init__(self, strings: TokenStrings, start: int = 0,
                 skip_special: bool = True) -> None:
        self.strings = strings
        self.chars = start
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_id: int) -> int:
        """The offset of the next token, ``token_id``."""
        at = self.chars
        if not (self.skip_special and token_id in self.strings.special):
            self.chars += len(self._utf8.decode(self.strings.raw(token_id)))
        return at


def completion_logprobs(entries: list[tuple[int, TokenLogprobs]], strings: TokenStrings,
                        offsets: TextOffsets, as_ids: bool = False) -> dict:
    """The legacy completions format: parallel lists. Each token's top_logprobs holds
    the token itself too, as OpenAI's does (up to logprobs + 1 entries); text_offset
    counts the text whatever names the tokens."""
    label = token_label(strings, as_ids)
    tokens, values, tops, text_offset = [], [], [], []
    for token_id, lp in entries:
        tokens.append(label(token_id))
        values.append(lp.logprob)
        top = {label(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
        top.setdefault(tokens[-1], lp.logprob)
        tops.append(top)
        text_offset.append(offsets.next(token_id))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": text_offset}


def chat_logprobs(entries: list[tuple[int, TokenLogprobs]], strings: TokenStrings,
                  as_ids: bool = False) -> dict:
    """Chat's format; each token's ``bytes`` are its own (TokenStrings.raw), which a
    client joins to rebuild characters split across tokens."""
    label = token_label(strings, as_ids)

    def item(token_id: int, value: float) -> dict:
        return {"token": label(token_id), "logprob": value,
                "bytes": list(strings.raw(token_id))}

    content = []
    for token_id, lp in entries:
        entry = item(token_id, lp.logprob)
        entry["top_logprobs"] = [item(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
        content.append(entry)
    return {"content": content}


class Formatter:
    """Builds one endpoint's bodies; subclasses fill in the per-choice parts."""

    object_full = ""
    object_chunk = ""

    def __init__(self, job: Job, strings: TokenStrings) -> None:
        self.job = job
        self.strings = strings
        # Choices whose prompt_logprobs were sent.
        self.sent: set[int] = set()

    def _envelope(self, obj: str) -> dict:
        job = self.job
        return {"id": job.request_id, "object": obj, "created": job.created, "model": job.model}

    def full(self) -> dict:
        body = self._envelope(self.object_full)
        body["choices"] = []
        for position, i in enumerate(self.shown()):
            choice = self.full_choice(i)
            choice["index"] = position
            body["choices"].append(choice)
        body["usage"] = self.job.usage()
        body["timing"] = self.job.timing()
        return body

    def _chunk(self, choice: dict) -> dict:
        body = self._envelope(self.object_chunk)
        body["choices"] = [choice]
        if self.job.continuous_usage:
            body["usage"] = self.job.usage()
        return body

    def chunk(self, delta: Delta, last: bool) -> Optional[dict]:
        """A stream chunk for ``delta``; None when it carries nothing."""
        choice = self.chunk_choice(delta)
        if choice is None:
            return None
        body = self._chunk(choice)
        if last and not self.job.include_usage:
            body["timing"] = self.job.timing()
        return body

    def usage_chunk(self) -> dict:
        body = self._envelope(self.object_chunk)
        body["choices"] = []
        body["usage"] = self.job.usage()
        body["timing"] = self.job.timing()
        return body

    def first_chunks(self) -> list[dict]:
        return []

    # -- a stream's bytes ------------------------------------------------------------

    def event(self, body: dict) -> bytes:
        """One server-sent event."""
        return b"data: " + _encode(body) + b"\n\n"

    def stream_delta(self, delta: Delta, last: bool) -> list[bytes]:
        """The events for one choice's delta (none when it carries nothing)."""
        chunk = self.chunk(delta, last)
        return [] if chunk is None else [self.event(chunk)]

    def stream_end(self) -> list[bytes]:
        """The events after every choice's last chunk."""
        usage = [self.event(self.usage_chunk())] if self.job.include_usage else []
        return usage + [DONE]

    def stream_error(self, error: "APIError") -> list[bytes]:
        """The events that end a stream an error cut."""
        return [self.event(error.body()), DONE]

    def shown(self) -> list[int]:
        """The choices a full response returns, in order: all of them, or with best_of
        the ``keep`` most likely of each prompt's (by the sum of their tokens' log
        probabilities, as OpenAI ranks them)."""
        job = self.job
        if job.keep is None:
            return list(range(len(job.choices)))
        out = []
        for start in range(0, len(job.choices), job.n):
            group = range(start, start + job.n)
            ranked = sorted(group, key=lambda i: -sum(lp.logprob for _, lp in
                                                      job.choices[i].logprobs))
            out.extend(sorted(ranked[:job.keep]))
        return out

    def full_choice(self, index: int) -> dict:
        raise NotImplementedError

    def chunk_choice(self, delta: Delta) -> Optional[dict]:
        raise NotImplementedError

    def _prompt_logprobs(self, out: dict, index: int) -> None:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token a
        map of token id -> {logprob, decoded_token} (the token itself and the most
        likely ones). On a full choice, and on a stream's first chunk of the choice."""
        c = self.job.choices[index]
        if not self.job.prompt_logprobs or c.prompt_logprobs is None or index in self.sent:
            return
        self.sent.add(index)
        entries: list = [None]
        for token_id, lp in zip(c.prompt_token_ids[1:], c.prompt_logprobs):
            entry = {str(t): {"logprob": v, "decoded_token": self.strings.text(t)}
                     for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            entry[str(token_id)] = {"logprob": lp.logprob,
                                    "decoded_token": self.strings.text(token_id)}
            entries.append(entry)
        out["prompt_logprobs"] = entries

    def _token_ids(self, out: dict, index: int, token_ids: list[int]) -> None:
        if self.job.return_token_ids:
            out["token_ids"] = token_ids
            out["prompt_token_ids"] = self.job.choices[index].prompt_token_ids


class CompletionFormatter(Formatter):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, job: Job, strings: TokenStrings) -> None:
        super().__init__(job, strings)
        self.offsets = [self.text_offsets(i) for i in range(len(job.choices))]
        # Streamed echo with logprobs: the choices whose prompt is still to be sent,
        # with the first chunk of their own, which brings the prompt's logprobs.
        self.echo_pending = (set(range(len(job.choices)))
                             if job.echo is not None and job.num_logprobs is not None
                             else set())

    def echo(self, index: int) -> str:
        return "" if self.job.echo is None else self.job.echo[index // self.job.n]

    def text_offsets(self, index: int) -> TextOffsets:
        """A counter of choice ``index``'s offsets, from the end of its echo."""
        return TextOffsets(self.strings, len(self.echo(index)),
                           self.job.choices[index].detokenizer.skip_special_tokens)

    def first_chunks(self) -> list[dict]:
        if self.job.echo is None or self.job.num_logprobs is not None:   # see echo_pending
            return []
        return [self._chunk({"index": index, "text": self.echo(index), "logprobs": None,
                             "finish_reason": None})
                for index in range(len(self.job.choices))]

    def full_choice(self, index: int) -> dict:
        c = self.job.choices[index]
        out = {"index": index, "text": self.echo(index) + "".join(c.text), "logprobs": None,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.job.num_logprobs is not None:
            out["logprobs"] = completion_logprobs(c.logprobs, self.strings,
                                                  self.text_offsets(index),
                                                  self.job.tokens_as_ids)
            if self.job.echo is not None:
                self._echo_logprobs(out["logprobs"], c)
        self._prompt_logprobs(out, index)
        self._token_ids(out, index, c.token_ids)
        return out

    def _echo_logprobs(self, logprobs: dict, c) -> None:
        """Puts the prompt's part of echo's logprobs before ``logprobs``' (its first
        token has none)."""
        n = self.job.num_logprobs
        first = c.prompt_token_ids[0]
        entries = [(t, TokenLogprobs(lp.logprob, lp.top_token_ids[:n], lp.top_logprobs[:n]))
                   for t, lp in zip(c.prompt_token_ids[1:], c.prompt_logprobs or [])]
        offsets = TextOffsets(self.strings, skip_special=False)   # as echo shows it
        # A text prompt's echo is its text: a BOS the tokenizer put before it is not.
        added = (first in self.strings.special
                 and not self.echo(c.index).startswith(self.strings.text(first)))
        at = offsets.chars if added else offsets.next(first)
        rest = completion_logprobs(entries, self.strings, offsets, self.job.tokens_as_ids)
        label = token_label(self.strings, self.job.tokens_as_ids)
        prompt = {"tokens": [label(first)] + rest["tokens"],
                  "token_logprobs": [None] + rest["token_logprobs"],
                  "top_logprobs": [None] + rest["top_logprobs"],
                  "text_offset": [at] + rest["text_offset"]}
        for key in prompt:
            logprobs[key] = prompt[key] + logprobs[key]

    def chunk_choice(self, delta: Delta) -> Optional[dict]:
        echo = delta.index in self.echo_pending
        if not (echo or delta.text or delta.finish_reason is not None
                or self.job.return_token_ids or delta.logprobs):
            return None
        out = {"index": delta.index, "text": delta.text, "logprobs": None,
               "finish_reason": delta.finish_reason}
        if delta.finish_reason is not None:
            out["stop_reason"] = self.job.choices[delta.index].stop_reason
        if self.job.num_logprobs is not None:
            out["logprobs"] = completion_logprobs(delta.logprobs, self.strings,
                                                  self.offsets[delta.index],
                                                  self.job.tokens_as_ids)
        if echo:   # the prompt and its logprobs before the first tokens
            self.echo_pending.discard(delta.index)
            out["text"] = self.echo(delta.index) + delta.text
            self._echo_logprobs(out["logprobs"], self.job.choices[delta.index])
        self._prompt_logprobs(out, delta.index)
        self._token_ids(out, delta.index, delta.token_ids)
        return out


class ChatFormatter(Formatter):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, job: Job, strings: TokenStrings) -> None:
        super().__init__(job, strings)
        plan = job.tool_plan
        self.parsers = None if plan is None else [ToolCallParser(plan) for _ in job.choices]
        # --reasoning-parser: each choice's thinking told apart from its answer, which
        # alone goes on to the tool-call parser.
        self.thinkers = None if job.reasoning is None else [
            job.reasoning.parser(thinking, calls=plan is not None)
            for thinking in job.thinks_first]

    def split(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """A choice's new text as (thinking, answer); ``final``: its last."""
        if self.thinkers is None:
            return "", text
        reasoning, content = self.thinkers[index].take(text, final)
        return (reasoning if self.job.include_reasoning else ""), content

    def _finish_reason(self, index: int, reason: Optional[str]) -> Optional[str]:
        if reason == "stop" and self.parsers is not None and self.parsers[index].calls:
            return "tool_calls"
        return reason

    def full_choice(self, index: int) -> dict:
        c = self.job.choices[index]
        reasoning, content = self.split(index, "".join(c.text), final=True)
        message: dict = {"role": "assistant", "content": content}
        if self.thinkers is not None:
            message["content"] = content or None
            message["reasoning_content"] = reasoning or None
        if self.parsers is not None:
            parser = self.parsers[index]
            message["content"] = parser.take(content, final=True)[0] or None
            if parser.calls:
                message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"}
                                         for call in parser.calls]
        out = {"index": index, "message": message, "logprobs": None,
               "finish_reason": self._finish_reason(index, c.finish_reason),
               "stop_reason": c.stop_reason}
        if self.job.num_logprobs is not None:
            out["logprobs"] = chat_logprobs(c.logprobs, self.strings, self.job.tokens_as_ids)
        self._prompt_logprobs(out, index)
        self._token_ids(out, index, c.token_ids)
        return out

    def first_chunks(self) -> list[dict]:
        return [self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for index in range(len(self.job.choices))]

    def chunk_choice(self, delta: Delta) -> Optional[dict]:
        finish_reason = delta.finish_reason
        reasoning, text = self.split(delta.index, delta.text, finish_reason is not None)
        calls: list[dict] = []
        if self.parsers is not None:
            text, calls = self.parsers[delta.index].take(text, finish_reason is not None)
            finish_reason = self._finish_reason(delta.index, finish_reason)
        if not text and not reasoning and not calls and finish_reason is None and not (
                self.job.return_token_ids or delta.logprobs):
            return None
        out_delta: dict = {"reasoning_content": reasoning} if reasoning else {}
        if text:
            out_delta["content"] = text
        if calls:
            out_delta["tool_calls"] = calls
        out = {"index": delta.index, "delta": out_delta, "logprobs": None,
               "finish_reason": finish_reason}
        if finish_reason is not None:
            out["stop_reason"] = self.job.choices[delta.index].stop_reason
        if self.job.num_logprobs is not None:
            out["logprobs"] = chat_logprobs(delta.logprobs, self.strings,
                                            self.job.tokens_as_ids)
        self._prompt_logprobs(out, delta.index)
        self._token_ids(out, delta.index, delta.token_ids)
        return out
