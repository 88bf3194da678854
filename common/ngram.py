"""Where speculation's proposals come from (engine_worker/speculation.py): a
request's own text, by n-gram lookup, or the output it predicted (OpenAI's
``prediction``, whose use the frontend reports in the usage). Searches run over the bytes of the ids (4 each), so that
``bytes.find`` runs in C; a match must start on an id's first byte."""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

NGRAM_MAX, NGRAM_MIN = 4, 2


def _search(data: bytes, pattern: bytes, lo: int = 0, hi: Optional[int] = None,
            last: bool = False) -> int:
    """Where ``pattern`` (ids' bytes) occurs in ``data`` on an id's first byte, within
    bytes [lo, hi): the first occurrence's id index (``last``: the last's), or -1."""
    hi = len(data) if hi is None else hi
    while True:
        at = data.rfind(pattern, lo, hi) if last else data.find(pattern, lo, hi)
        if at < 0 or at % 4 == 0:
            return at // 4 if at >= 0 else -1
        if last:   # misaligned: look further back, or further on
            hi = at + len(pattern) - 1
        else:
            lo = at + 1


def propose(token_ids: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n
    tokens of ``token_ids`` (the longest n that occurs), or none."""
    if k <= 0 or len(token_ids) <= NGRAM_MIN:
        return []
    data = array("i", token_ids).tobytes()
    for n in range(min(NGRAM_MAX, len(token_ids) - 1), NGRAM_MIN - 1, -1):
        # an occurrence ending before the last token
        at = _search(data, data[-4 * n:], hi=len(data) - 4, last=True)
        if at >= 0:
            return token_ids[at + n:at + n + k]
    return []


class Prediction:
    """A request's predicted output (OpenAI's ``prediction``: text the reply is
    expected to mostly repeat, such as a file being edited). It proposes what follows,
    in the prediction, the place the output has reached there: from its start, then
    token by token while the output follows it; where the output departs, the place
    is found again from the output's last n tokens (n from 4 down to 2), at the first
    occurrence after where it was lost, else the first anywhere."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = list(token_ids)
        self._data = array("i", self.token_ids).tobytes()
        self.at: Optional[int] = 0   # where in the prediction the output has reached
        self.lost = 0                # where in it the output last departed from it
        self.departed = 0            # the output token that did
        self.seen = 0                # output tokens accounted for
        self.followed = 0            # output tokens where the prediction put them

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens the prediction says come after ``output``."""
        self._follow(output, len(output))
        return [] if self.at is None or k <= 0 else self.token_ids[self.at:self.at + k]

    def count(self, output: Sequence[int]) -> tuple[int, int]:
        """Of the prediction's tokens, those ``output`` holds where the prediction
        put them (found again where it departs) and the rest: OpenAI's accepted and
        rejected prediction tokens."""
        for end in range(self.seen + 1, len(output) + 1):
            self._follow(output, end)
        return self.followed, max(0, len(self.token_ids) - self.followed)

    def _follow(self, output: Sequence[int], end: int) -> None:
        """Account for ``output[:end]``."""
        for i in range(self.seen, end):
            if self.at is not None and self.at < len(self.token_ids) \
                    and self.token_ids[self.at] == output[i]:
                self.at += 1
                self.followed += 1
            elif self.at is not None:
                self.lost, self.departed, self.at = self.at, i, None
        self.seen = end
        if self.at is None:
            found = self._find(output, end)
            if found is not None:   # the n-gram found is where it put those tokens too
                self.at, n = found
                self.followed += min(n, end - self.departed)

    def _find(self, output: Sequence[int], end: int) -> Optional[tuple[int, int]]:
        """Where the prediction goes on after the n tokens before ``end``, and n."""
        for n in range(min(NGRAM_MAX, end), NGRAM_MIN - 1, -1):
            pattern = array("i", output[end - n:end]).tobytes()
            for start in (4 * self.lost, 0):
                at = _search(self._data, pattern, start)
                if at >= 0:
                    return at + n, n
        return None
