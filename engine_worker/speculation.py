"""N-gram speculation (``--speculative-tokens K``, prompt lookup decoding): a decoding
request proposes up to K tokens copied from its own text, and one step checks them.
Without it, on the CPU engine, only requests that carry a prediction (OpenAI's
predicted output) propose, from their prediction.

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

from typing import Optional

import torch

from common.ngram import propose
from engine_worker.request import Request
from engine_worker.sampler import distribution

# Proposals are made while a step's decode rows and proposed tokens stay within this
# many. Checking them is nearly free only while a step's time is reading the weights;
# past that it is computing rows, many of them rejected proposals. On 2 cores (AMD
# EPYC Zen 5) a step of 16 rows takes 1.4x one of 8 (int8 weights) and 1.9x (4-bit),
# and proposals at 8 streams gave 0.76-0.95x with 4-bit weights, even on replies
# that copy, and 0.90-0.94x at 4 streams on replies that copy less. So: up to 7
# proposals for one stream, one each for four, none from 8; with 4-bit weights, whose
# kernels are bound by their arithmetic from fewer rows (IQ4's and MXFP4's too), up to 4 for one
# stream.
MAX_STEP_ROWS = 8
MAX_STEP_ROWS_Q4 = 5


# Without --speculative-tokens, the proposals a request with a prediction makes a step
# (as many as a step of one stream checks).
PREDICTED_TOKENS = MAX_STEP_ROWS - 1


def max_step_rows(weight_format: str) -> int:
    return MAX_STEP_ROWS_Q4 if weight_format in ("q4", "iq4", "mxfp4") else MAX_STEP_ROWS


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


class Speculator:
    """The engine's part: each request's proposals (the scheduler's drafter), the check
    of a step's proposed tokens against its logits, and the counts of both."""

    def __init__(self, k: int, max_model_len: int, generator: torch.Generator,
                 own_text: bool = True) -> None:
        """own_text: requests without a prediction propose from their own text (else
        they do not speculate)."""
        self.k = k
        self.own_text = own_text
        self.max_model_len = max_model_len
        # The sampler's: a sampled check draws from the engine's stream of draws.
        self.generator = generator
        self.num_draft_tokens = self.num_accepted_tokens = 0

    def propose(self, request: Request, most: int) -> list[int]:
        """The request's prediction's next tokens where it has one, else its own
        text's n-gram proposal."""
        if request.prediction is None and not self.own_text:
            return []
        k = min(request.draft_limit or self.k, most, request.draft_room(self.max_model_len))
        if request.prediction is not None:
            return request.prediction.propose(request.output_token_ids, k)
        return propose(request.token_ids, k)

    def record(self, draft_logits: list[tuple[Request, torch.Tensor]]) -> None:
        """What the model generates at each of a forward's proposed tokens: the most
        likely token for a greedy request; for a sampled one, the proposal where it is
        kept, else a draw without it (check_sampled); -1 where the logits are not
        finite. One pass for the step's rows."""
        if not draft_logits:
            return
        logits = torch.cat([rows for _, rows in draft_logits])
        check = logits.argmax(dim=-1)
        sampled = [(r, len(rows)) for r, rows in draft_logits if not r.params.greedy]
        if sampled:
            where = torch.tensor([not r.params.greedy for r, rows in draft_logits
                                  for _ in range(len(rows))])
            proposed = torch.tensor([t for r, n in sampled for t in r.token_ids[-n:]])
            probs, codes = distribution(logits[where], [r.params for r, n in sampled
                                                        for _ in range(n)])
            drawn = check_sampled(probs, proposed, self.generator)
            check[where] = torch.where(codes == 0, drawn, -1)
        check[~torch.isfinite(logits).all(dim=-1)] = -1
        ids, at = check.tolist(), 0
        for request, rows in draft_logits:
            request.draft_check = ids[at:at + len(rows)]
            at += len(rows)

    def checked(self, request: Request, sampled: int) -> Optional[list[int]]:
        """A request that proposed tokens, after its step: those the model would have
        generated are kept, then the model's own next token (``sampled``, after them
        all, when every proposal is kept); the rest is taken off, and its KV with it.
        The tokens to append (each but the last computed), or None where the logits
        were not finite."""
        check = request.draft_check
        draft = request.drop_draft()
        request.num_computed_tokens -= len(draft)
        kept = 0
        while kept < len(draft) and check is not None and check[kept] == draft[kept]:
            kept += 1
        following = sampled if kept == len(draft) else (-1 if check is None else check[kept])
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += kept
        request.draft_limit = min(self.k, kept + 1)
        return None if following < 0 else draft[:kept] + [following]
