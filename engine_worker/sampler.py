"""Choosing each request's next token from its logits, per request inside one batch.

Order of processing, per row: logprobs are read from the raw distribution first
(log_softmax of the model's logits); then repetition, presence and frequency
penalties; then stop tokens are banned while min_tokens is not reached. A greedy row
(temperature 0, or top_k 1) takes the argmax of that. A sampled row is divided by its
temperature, cut by top_k, top_p and min_p, and drawn from: with the request's own
generator when it has a seed (so the draw does not depend on what else is batched),
otherwise with the engine's generator.

Every stage is skipped when no row of the batch needs it, so an all-greedy batch
costs one argmax.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from common.protocol import TokenLogprobs
from engine_worker.kernels import CpuKernels
from engine_worker.request import Request


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

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]
                 ) -> tuple[list[int], list[Optional[TokenLogprobs]]]:
        """logits (S, V), one row per request -> token ids and logprobs, per request.
        May modify ``logits`` in place."""
        logits = logits.float()
        params = [r.params for r in requests]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
               for p in params):
            apply_penalties(logits, requests)
        banned = [i for i, r in enumerate(requests)
                  if r.num_output_tokens < r.params.min_tokens and r.stop_ids]
        for i in banned:
            logits[i, list(requests[i].stop_ids)] = float("-inf")

        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(greedy) == len(params):
            token_ids = self.argmax(logits)
        else:
            if greedy:
                rows = torch.tensor(greedy, device=logits.device)
                token_ids[rows] = self.argmax(logits[rows])
            rows = torch.tensor(sampled, device=logits.device)
            token_ids[rows] = self._sample(logits[rows], [requests[i] for i in sampled])

        ids = token_ids.tolist()
        logprobs: list[Optional[TokenLogprobs]] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    logprobs[i] = _token_logprobs(raw_logprobs[i], ids[i], p.logprobs)
        return ids, logprobs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """(S', V) logits of sampled rows -> (S',) token ids."""
        params = [r.params for r in requests]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        if any(p.top_k is not None for p in params):
            logits = apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            logits = apply_top_p(logits, [p.top_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            probs = apply_min_p(probs, [p.min_p for p in params])

        out = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        shared = []
        for i, r in enumerate(requests):
            if r.params.seed is None:
                shared.append(i)
                continue
            if r.generator is None:
                r.generator = torch.Generator(device=self.device)
                r.generator.manual_seed(r.params.seed & 0xFFFF_FFFF_FFFF_FFFF)
            out[i] = torch.multinomial(probs[i], 1, generator=r.generator)[0]
        if shared:
            rows = torch.tensor(shared, device=logits.device)
            out[rows] = torch.multinomial(probs[rows], 1, generator=self.generator).squeeze(1)
        return out


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


def _token_logprobs(logprobs: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        top_ids, top_values = ids.tolist(), values.tolist()
    else:
        top_ids, top_values = [], []
    return TokenLogprobs(float(logprobs[token_id]), top_ids, top_values)
