"""Turning a stream of output token ids into text, and stopping on stop strings.

Incremental detokenization: decoding tokens one at a time breaks in two ways: a
multi-byte UTF-8 character split across tokens decodes to U+FFFD halves, and
tokenizers that mark word starts (SentencePiece's "▁") lose the space between words
when a token is decoded alone. So each step decodes a short window of recent tokens
twice, with and without the new ones, and emits the difference; while the newest
text ends in U+FFFD (a character still incomplete) nothing is emitted and the window
grows. The window starts on the last few prompt tokens, for context, but only text
after the prompt is ever emitted.

Stop strings: the matcher sees every emitted piece, finds a stop string even when it
spans tokens, and holds back only the tail that could still be the beginning of one.
The stop string itself is emitted only when asked (include_stop_str_in_output).
"""

from __future__ import annotations

from typing import Optional, Sequence

# Prompt tokens decoded as context for the first output tokens.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        """``tokenizer``: a ``tokenizers.Tokenizer`` (the Rust one)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # Text of tokens[prefix:read] has been emitted (or is prompt context);
        # tokens[read:] are new.
        self.prefix = 0
        self.read = len(self.tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they complete (possibly "")."""
        self.tokens.extend(token_ids)
        before = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        if after.endswith(_REPLACEMENT):
            return ""  # a character is still incomplete: wait for more tokens
        if not after.startswith(before):
            # Context decoded differently once extended (rare cleanup rules): emit
            # from the first differing character, never repeating emitted text.
            common = 0
            for a, b in zip(before, after):
                if a != b:
                    break
                common += 1
            delta = after[common:]
        else:
            delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        return delta

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        before = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        self.prefix = self.read = len(self.tokens)
        return after[len(before):] if after.startswith(before) else ""


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        self.stop = [s for s in stop if s]
        # Release the stop string itself as the text's end (include_stop_str_in_output).
        self.include_stop = include_stop
        self.held = ""
        self.stopped: Optional[str] = None

    def push(self, text: str) -> str:
        """Feed emitted text; return what can be released now. After a stop string
        is found, ``stopped`` names it and nothing more is released."""
        if self.stopped is not None:
            return ""
        if not self.stop:
            return text
        buffer = self.held + text
        first: Optional[tuple[int, str]] = None
        for s in self.stop:
            i = buffer.find(s)
            if i != -1 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.stopped = first[1]
            self.held = ""
            return buffer[:first[0] + (len(first[1]) if self.include_stop else 0)]
        keep = partial_suffix(buffer, self.stop)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation: release the held-back tail."""
        out, self.held = ("" if self.stopped is not None else self.held), ""
        return out


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of
    ``markers`` (it might still become one)."""
    best = 0
    for s in markers:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StreamSplitter:
    """A reply's text split in two as it streams (thinking and answer; answer and tool
    calls): ``push(text)`` gives what each part gained, ``finish()`` what was held at
    the end; ``take`` is ``push``, and when the text is the reply's last, ``finish``
    too."""

    def take(self, text: str, final: bool) -> tuple:
        first, second = self.push(text)
        if final:
            more, rest = self.finish()
            first, second = first + more, second + rest
        return first, second

