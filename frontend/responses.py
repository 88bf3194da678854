"""OpenAI response bodies and stream chunks, as plain dicts (encoded with msgspec).

The per-request timing breakdown rides in an extension field, ``timing``:
tokenize_ms, queue_ms and prefill_ms (engine-side durations) and ttft_ms (as the
server saw it), on the non-streaming response and on the last chunk of a stream.
"""

from __future__ import annotations

from typing import Callable, Optional

from common.protocol import TokenLogprobs
from frontend.choice import Delta
from frontend.serving import Job

TokenText = Callable[[int], str]


def completion_logprobs(entries: list[tuple[int, TokenLogprobs]], token_text: TokenText,
                        text_offset: int) -> dict:
    """The legacy completions format: parallel lists."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in entries:
        text = token_text(token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: list[tuple[int, TokenLogprobs]], token_text: TokenText) -> dict:
    def item(token_id: int, value: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

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

    def __init__(self, job: Job, token_text: TokenText) -> None:
        self.job = job
        self.token_text = token_text

    def _envelope(self, obj: str) -> dict:
        job = self.job
        return {"id": job.request_id, "object": obj, "created": job.created, "model": job.model}

    def full(self) -> dict:
        body = self._envelope(self.object_full)
        body["choices"] = [self.full_choice(i) for i in range(len(self.job.choices))]
        body["usage"] = self.job.usage()
        body["timing"] = self.job.timing()
        return body

    def chunk(self, delta: Delta, last: bool) -> Optional[dict]:
        """A stream chunk for ``delta``; None when it carries nothing."""
        choice = self.chunk_choice(delta)
        if choice is None:
            return None
        body = self._envelope(self.object_chunk)
        body["choices"] = [choice]
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

    def full_choice(self, index: int) -> dict:
        raise NotImplementedError

    def chunk_choice(self, delta: Delta) -> Optional[dict]:
        raise NotImplementedError

    def _token_ids(self, out: dict, index: int, token_ids: list[int]) -> None:
        if self.job.return_token_ids:
            out["token_ids"] = token_ids
            out["prompt_token_ids"] = self.job.choices[index].prompt_token_ids


class CompletionFormatter(Formatter):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, job: Job, token_text: TokenText) -> None:
        super().__init__(job, token_text)
        self.offsets = [0] * len(job.choices)

    def full_choice(self, index: int) -> dict:
        c = self.job.choices[index]
        out = {"index": index, "text": "".join(c.text), "logprobs": None,
               "finish_reason": c.finish_reason}
        if self.job.num_logprobs is not None:
            out["logprobs"] = completion_logprobs(c.logprobs, self.token_text, 0)
        self._token_ids(out, index, c.token_ids)
        return out

    def chunk_choice(self, delta: Delta) -> Optional[dict]:
        if not delta.text and delta.finish_reason is None and not (
                self.job.return_token_ids or delta.logprobs):
            return None
        out = {"index": delta.index, "text": delta.text, "logprobs": None,
               "finish_reason": delta.finish_reason}
        if self.job.num_logprobs is not None:
            out["logprobs"] = completion_logprobs(delta.logprobs, self.token_text,
                                                  self.offsets[delta.index])
        self.offsets[delta.index] += len(delta.text)
        self._token_ids(out, delta.index, delta.token_ids)
        return out


class ChatFormatter(Formatter):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def full_choice(self, index: int) -> dict:
        c = self.job.choices[index]
        out = {"index": index,
               "message": {"role": "assistant", "content": "".join(c.text)},
               "logprobs": None, "finish_reason": c.finish_reason}
        if self.job.num_logprobs is not None:
            out["logprobs"] = chat_logprobs(c.logprobs, self.token_text)
        self._token_ids(out, index, c.token_ids)
        return out

    def first_chunks(self) -> list[dict]:
        chunks = []
        for index in range(len(self.job.choices)):
            body = self._envelope(self.object_chunk)
            body["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
            chunks.append(body)
        return chunks

    def chunk_choice(self, delta: Delta) -> Optional[dict]:
        if not delta.text and delta.finish_reason is None and not (
                self.job.return_token_ids or delta.logprobs):
            return None
        out = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
               "logprobs": None, "finish_reason": delta.finish_reason}
        if self.job.num_logprobs is not None:
            out["logprobs"] = chat_logprobs(delta.logprobs, self.token_text)
        self._token_ids(out, delta.index, delta.token_ids)
        return out
