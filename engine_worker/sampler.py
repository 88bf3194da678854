"""Choosing each request's next token from its logits, per request inside one batch.

Order of processing, per row: logprobs are read from the raw distribution first
(log_softmax of the model's logits); then the request's own logits processing runs
(repetition, presence and frequency penalties; stop tokens banned while min_tokens is
not reached; logit_bias, allowed_token_ids and bad words; the grammar's mask of a
structured output; any extra ``Request.logits_processors``). A greedy row (temperature
below 1e-5, or top_k 1) takes the argmax of that. A sampled row is divided by its
temperature, cut by top_k, top_p and min_p, and drawn from: with the request's own
generator when it has a seed (so the draw does not depend on what else is batched),
otherwise with the engine's generator.

Failure isolation: one row's trouble is that row's alone. Its logits processing runs
inside its own try; a row whose logits end up NaN, +inf or all -inf (nothing left to
choose) is not drawn from. Either way the row gets an error, and the other rows are
sampled exactly as if it were not there (no generator of theirs is advanced for it).

Every stage is skipped when no row of the batch needs it, so an all-greedy batch
costs one argmax plus one row-wise max.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from common.protocol import TokenLogprobs
from engine_worker.kernels import CpuKernels
from engine_worker.request import Request

logger = logging.getLogger(__name__)


@dataclass
class Samples:
    """One step's draws, by row: a token id, or None for a row that failed."""

    token_ids: list[Optional[int]]
    logprobs: list[Optional[TokenLogprobs]]
    # Row -> what went wrong with it.
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(self, device: torch.device, seed: int,
                 kernels: Optional[CpuKernels] = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kernels = kernels

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and logits.device.type == "cpu":
            return self.kernels.argmax_rows(logits)
        return logits.argmax(dim=-1)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> Samples:
        """logits (S, V), one row per request. May modify ``logits`` in place."""
        logits = logits.float()
        n = len(requests)
        errors: dict[int, str] = {}
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        for i, request in enumerate(requests):
            if request.needs_logits_processing:
                try:
                    process_logits(logits[i], request)
                except Exception as e:  # the request's own processing: its failure alone
                    logger.exception("logits processing failed for %s", request.request_id)
                    errors[i] = f"logits processing failed: {type(e).__name__}: {e}"

        constrained = [i for i, r in enumerate(requests) if r.grammar is not None
                       and i not in errors]
        if constrained:
            self.apply_grammars(logits, [requests[i] for i in constrained], constrained,
                                errors)

        greedy = [i for i, r in enumerate(requests) if r.params.greedy and i not in errors]
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy and i not in errors]
        token_ids: list[Optional[int]] = [None] * n
        if greedy:
            rows = logits if len(greedy) == n else logits[greedy]
            _check_rows(rows, greedy, errors)
            for i, token_id in zip(greedy, self.argmax(rows).tolist()):
                if i not in errors:
                    token_ids[i] = token_id
        if sampled:
            drawn = self._sample(logits[sampled], [requests[i] for i in sampled], sampled, errors)
            for i, token_id in zip(sampled, drawn):
                if i not in errors:
                    token_ids[i] = token_id

        logprobs: list[Optional[TokenLogprobs]] = [None] * n
        if raw_logprobs is not None:
            for i, r in enumerate(requests):
                if r.params.logprobs is not None and token_ids[i] is not None:
                    logprobs[i] = token_logprobs(raw_logprobs[i:i + 1], [token_ids[i]],
                                                 r.params.logprobs)[0]
        return Samples(token_ids, logprobs, errors)

    def apply_grammars(self, logits: torch.Tensor, requests: list[Request], rows: list[int],
                       errors: dict[int, str]) -> None:
        """Every structured-output row's grammar mask, applied in one operation. A
        grammar in error fails its row alone."""
        matchers = [r.grammar for r in requests]
        allowed = torch.from_numpy(matchers[0].compiler.allowed(matchers))
        index = torch.tensor(rows, device=logits.device)
        width = min(allowed.shape[1], logits.shape[1])
        masked = logits.index_select(0, index)
        masked[:, :width].masked_fill_(~allowed[:, :width].to(logits.device), float("-inf"))
        masked[:, width:] = float("-inf")  # ids the tokenizer does not have
        logits.index_copy_(0, index, masked)
        for row, matcher in zip(rows, matchers):
            if matcher.error is not None:
                errors[row] = matcher.error

    def _sample(self, logits: torch.Tensor, requests: list[Request], rows: list[int],
                errors: dict[int, str]) -> list[int]:
        """(S', V) logits of sampled rows -> S' token ids (meaningless for rows that
        land in ``errors``, keyed by their index in the whole batch, ``rows``)."""
        params = [r.params for r in requests]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        if any(p.top_k is not None for p in params):
            logits = apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            logits = apply_top_p(logits, [p.top_p for p in params])
        # A finite maximum makes the softmax finite (it subtracts the maximum), and
        # top_p and min_p always keep the most likely token: the draw cannot fail.
        _check_rows(logits, rows, errors)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            probs = apply_min_p(probs, [p.min_p for p in params])

        out = [0] * len(requests)
        shared = []
        for j, r in enumerate(requests):
            if rows[j] in errors:
                continue
            if r.params.seed is None:
                shared.append(j)
                continue
            if r.generator is None:
                r.generator = torch.Generator(device=self.device)
                r.generator.manual_seed(r.params.seed & 0xFFFF_FFFF_FFFF_FFFF)
            out[j] = int(torch.multinomial(probs[j], 1, generator=r.generator)[0])
        if shared:
            draws = torch.multinomial(probs[shared], 1, generator=self.generator).squeeze(1)
            for j, token_id in zip(shared, draws.tolist()):
                out[j] = token_id
        return out


def _check_rows(logits: torch.Tensor, rows: list[int], errors: dict[int, str]) -> None:
    """Flag rows with nothing valid to choose from: a NaN or +inf anywhere (the
    maximum propagates NaN), or every token at -inf."""
    row_max = logits.amax(dim=-1)
    bad = (~torch.isfinite(row_max)).nonzero().flatten().tolist()
    for j in bad:
        value = row_max[j].item()
        errors[rows[j]] = ("the logits hold NaN" if value != value else
                           "the logits hold +inf" if value > 0 else
                           "every token is excluded (all logits are -inf)")


def process_logits(row: torch.Tensor, request: Request) -> None:
    """One request's own processing of its logits row (V,), in place: penalties, the
    stop-token ban before min_tokens, logit bias, the allowed and banned tokens, then
    its extra logits processors. (Grammars are applied to all rows at once after it:
    apply_grammars.)"""
    p = request.params
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        apply_penalties(row.unsqueeze(0), [request])
    if request.num_output_tokens < p.min_tokens and request.stop_ids:
        row[list(request.stop_ids)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        row.masked_fill_(~keep, float("-inf"))
    if p.bad_words_ids:
        banned = [word[-1] for word in p.bad_words_ids
                  if len(word) == 1 or request.token_ids[-(len(word) - 1):] == word[:-1]]
        if banned:
            row[banned] = float("-inf")
    for processor in request.logits_processors:
        processor(row, request)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """In place. Repetition penalty over prompt and output tokens (logit / p if positive,
    * p if negative); presence and frequency penalties over output tokens
    (logit - presence * [count > 0] - frequency * count)."""
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        p = r.params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(r.token_ids, device=logits.device)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty,
                                    row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if (p.presence_penalty or p.frequency_penalty) and r.num_output_tokens:
            out_ids = torch.tensor(r.output_token_ids, device=logits.device)
            counts = torch.bincount(out_ids, minlength=vocab).to(logits.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_ks: list[Optional[int]]) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept)."""
    vocab = logits.shape[1]
    ks = [min(k, vocab) if k is not None else vocab for k in top_ks]
    kth = torch.topk(logits, max(ks), dim=-1).values  # (S, max_k), descending
    idx = torch.tensor([k - 1 for k in ks], device=logits.device).unsqueeze(1)
    threshold = kth.gather(1, idx)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
    top_p = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
    drop_sorted = before >= top_p  # the first token is always kept (before == 0)
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely token."""
    min_p = torch.tensor(min_ps, device=probs.device).unsqueeze(1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    return probs.masked_fill(probs < threshold, 0.0)


def token_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int], top_n: int
                   ) -> list[TokenLogprobs]:
    """Per row of ``logprobs`` (N, V): the logprob of its token in ``token_ids`` and
    the ``top_n`` most likely tokens."""
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)
                             .unsqueeze(1)).squeeze(1).tolist()
    if not top_n:
        return [TokenLogprobs(c, [], []) for c in chosen]
    values, ids = torch.topk(logprobs, top_n, dim=-1)
    return [TokenLogprobs(c, i, v) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]
