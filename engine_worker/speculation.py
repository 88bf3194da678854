"""N-gram speculation (``--speculative-tokens K``, prompt lookup decoding): a decoding
request proposes up to K tokens copied from its own text, and one step checks them.

The proposal: the latest earlier place where the request's last n tokens (n from 4
down to 2) occur in its prompt or output, and the K tokens that followed it there.
Replies that quote, repeat or edit their input (summaries, code changes, extraction,
structured data) continue their own text often. The step then computes the request's
last token and the K proposed ones together (their KV written, as a prompt chunk's),
and their logits say, position by position, what the model would have generated: the
proposals are kept up to the first that differs, and the model's own token follows
them. A step reads the weights once for up to K + 1 tokens, which is nearly free where
decoding is bound by memory (a CPU at small batches).

Greedy requests keep a proposal where it is the most likely token, so their output is
the one decoding token by token gives. Sampled ones keep it with the probability the
request's distribution gives it (after temperature, top-k, top-p, min-p), and where
one is not kept, draw from that distribution without it (``check_sampled``): each
token is distributed as in decoding one at a time. Seeded requests decode as usual
(their draws would depend on what else shares the step), as do requests that read
their tokens while sampling (penalties, grammars, logit bias, allowed or banned
tokens, min_tokens not reached) or want logprobs.
"""

from __future__ import annotations

from array import array

import torch

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


def check_sampled(probs: torch.Tensor, draft: torch.Tensor,
                  generator: torch.Generator) -> torch.Tensor:
    """Per row of ``probs`` (R, V), a sampled request's distribution at a proposed
    token ``draft`` (R,): the proposal where it is kept (with probability p(draft)),
    else a draw from p without it. A token comes out of it with probability p: the
    proposal with p(x) x 1, any other y with (1 - p(x)) x p(y) / (1 - p(x))."""
    kept = torch.rand(draft.shape[0], generator=generator, device=probs.device) \
        < probs.gather(1, draft.unsqueeze(1)).squeeze(1)
    rest = probs.scatter(1, draft.unsqueeze(1), 0.0)
    noise = torch.empty_like(rest).exponential_(generator=generator)
    drawn = (rest / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return torch.where(kept, draft, drawn)


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
