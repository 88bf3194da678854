"""N-gram speculation (``--speculative-tokens K``, prompt lookup decoding): a decoding
request proposes up to K tokens copied from its own text, and one step checks them.

The proposal: the latest earlier place where the request's last n tokens (n from 4
down to 2) occur in its prompt or output, and the K tokens that followed it there.
Replies that quote, repeat or edit their input (summaries, code changes, extraction,
structured data) continue their own text often. The step then computes the request's
last token and the K proposed ones together (their KV written, as a prompt chunk's),
and their logits say, position by position, what the model would have generated: the
proposals are kept up to the first that differs, and the model's own token follows
them. Greedy decoding only, so the output is the one decoding token by token gives;
a step reads the weights once for up to K + 1 tokens, which is nearly free where
decoding is bound by memory (a CPU at small batches).

Requests that read their tokens while sampling (penalties, grammars, logit bias,
allowed or banned tokens, min_tokens not reached) or want logprobs decode as usual.
"""

from __future__ import annotations

from array import array

NGRAM_MAX, NGRAM_MIN = 4, 2
# Proposals are made while a step's decode rows and proposed tokens stay within this
# many. Checking them is nearly free only while a step's time is reading the weights;
# past that it is computing rows, many of them rejected proposals. On 2 cores (AMD
# EPYC Zen 5) a step of 16 rows takes 1.4x one of 8 (int8 weights) and 1.9x (4-bit),
# and proposals at 8 streams gave 0.76-0.95x with 4-bit weights, even on replies
# that copy, and 0.90-0.94x at 4 streams on replies that copy less. So: up to 7
# proposals for one stream, one each for four, none from 8; with 4-bit weights, whose
# kernels are bound by their arithmetic from fewer rows, up to 4 for one stream.
MAX_STEP_ROWS = 8
MAX_STEP_ROWS_Q4 = 5


def max_step_rows(weight_format: str) -> int:
    return MAX_STEP_ROWS_Q4 if weight_format.startswith("q4") else MAX_STEP_ROWS


def propose(token_ids: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n
    tokens of ``token_ids`` (the longest n that occurs), or none."""
    if k <= 0 or len(token_ids) <= NGRAM_MIN:
        return []
    # A search over the bytes of the ids (4 each): bytes.rfind runs in C.
    data = array("i", token_ids).tobytes()
    for n in range(min(NGRAM_MAX, len(token_ids) - 1), NGRAM_MIN - 1, -1):
        suffix = data[-4 * n:]
        end = len(data) - 4  # an occurrence ending before the last token
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return token_ids[start:start + k]
            end = at + 4 * n - 1  # misaligned: look further back
    return []
