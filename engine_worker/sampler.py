"""Choosing each request's next token from its logits, per request inside one batch,
on the logits' device, with one device-to-host copy per step.

Order of processing, per row: logprobs are read from the raw distribution first
(log_softmax of the model's logits); then the request's own logits processing runs
(repetition, presence and frequency penalties; stop tokens banned while min_tokens is
not reached; logit_bias, allowed_token_ids and bad words; the grammar's mask of a
structured output, all masks uploaded in one copy; any extra
``Request.logits_processors``). A greedy row (temperature below 1e-5, or top_k 1)
takes the argmax of that. A sampled row is divided by its temperature, cut by top_k,
top_p (which always keeps the most likely token) and min_p, and drawn by the
exponential race: the argmax of p / E with E ~ Exp(1) drawn per token, which picks
token i with probability p_i, in one pass and without a cumulative sum. A request with
a seed draws its E from its own generator (so its draws do not depend on what else is
batched), the others from the engine's.

Everything a step returns (token ids, a validity code per row, the chosen token's
logprob and the top-n) is packed into one tensor and copied to the host once.
``launch`` queues the draws and that copy and returns at once: the token ids stay on
the device too, where a next step queued before the host reads them takes its inputs
(the engine's run-ahead); ``result()`` waits for the copy. On the
CPU's C kernels, a step whose rows are all greedy and want no logprobs takes its tokens
and validity codes from one pass over the logits instead (``greedy_pass``).

Failure isolation: one row's trouble is that row's alone. Its logits processing runs
inside its own try; a row whose logits end up NaN, +inf or all -inf (nothing left to
choose) gets an error, and the other rows are sampled exactly as if it were not there
(a seeded row's generator advances the same whatever its neighbours hold).

Penalties keep their counts per request on the device (``PenaltyState``), adding the
tokens generated since the last step instead of re-reading the whole history.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from common.protocol import SamplingParams, TokenLogprobs
from engine_worker.cpu.kernels import CpuKernels
from engine_worker.request import Request

logger = logging.getLogger(__name__)

# Validity codes of a row, and what they mean.
_ROW_ERRORS = {1: "the logits hold NaN", 2: "the logits hold +inf",
               3: "every token is excluded (all logits are -inf)"}


@dataclass
class Samples:
    """One step's draws, by row: a token id, or None for a row that failed."""

    token_ids: list[Optional[int]]
    logprobs: list[Optional[TokenLogprobs]]
    # Row -> what went wrong with it.
    errors: dict[int, str] = field(default_factory=dict)


class PenaltyState:
    """A request's token counts on the device, for its penalties: prompt and output
    tokens seen (repetition), output token counts (presence, frequency)."""

    def __init__(self, request: Request, vocab: int, device: torch.device) -> None:
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor(request.token_ids[:request.num_prompt_tokens], device=device)] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.num_counted = 0  # output tokens counted so far

    def update(self, request: Request) -> None:
        new = request.output_token_ids[self.num_counted:]
        if new:
            ids = torch.tensor(new, device=self.counts.device)
            self.seen[ids] = True
            self.counts.index_add_(0, ids, torch.ones(len(new), device=self.counts.device))
            self.num_counted += len(new)


class PendingSamples:
    """A step's draws on their way to the host. ``tokens`` (S,) int64, on the logits'
    device: what a next step scheduled before the host has seen them reads as its input
    ids. ``result()`` waits for the host copy (the first call only) and returns them."""

    def __init__(self, tokens: torch.Tensor, read: Callable[[], list], requests: Sequence[Request],
                 top_n: Optional[int], errors: dict[int, str]) -> None:
        self.tokens = tokens
        self._read = read
        self._requests = requests
        self._top_n = top_n
        self._errors = errors
        self._samples: Optional[Samples] = None

    @classmethod
    def ready(cls, samples: Samples, device: torch.device) -> "PendingSamples":
        """Draws already on the host (a failed row's token is 0: its row is ignored)."""
        ids = [t or 0 for t in samples.token_ids]
        tokens = (torch.tensor(ids, dtype=torch.int64).to(device) if ids
                  else torch.empty(0, dtype=torch.int64, device=device))
        pending = cls(tokens, list, [], None, {})
        pending._samples = samples
        return pending

    def result(self) -> Samples:
        if self._samples is None:
            self._samples = _unpack(self._read(), self._requests, self._top_n, self._errors)
        return self._samples


def _unpack(host: list, requests: Sequence[Request], top_n: Optional[int],
            errors: dict[int, str]) -> Samples:
    """Samples from each row's (token, validity code, logprobs...) as copied to the host."""
    n = len(requests)
    token_ids: list[Optional[int]] = [None] * n
    logprobs: list[Optional[TokenLogprobs]] = [None] * n
    for i, row in enumerate(host):
        if i in errors:
            continue
        code = int(row[1])
        if code:
            errors[i] = _ROW_ERRORS[code]
            continue
        token_ids[i] = int(row[0])
        want = requests[i].params.logprobs
        if want is not None:
            top_ids = [int(x) for x in row[3 + top_n:3 + top_n + want]]
            logprobs[i] = TokenLogprobs(row[2], top_ids, row[3:3 + want])
    return Samples(token_ids, logprobs, errors)


class Sampler:
    def __init__(self, device: torch.device, seed: int,
                 kernels: Optional[CpuKernels] = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kernels = kernels

    def _c_kernels_take(self, logits: torch.Tensor) -> bool:
        return self.kernels is not None and logits.device.type == "cpu"

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self._c_kernels_take(logits):
            return self.kernels.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> Samples:
        """logits (S, V), one row per request. May modify ``logits`` in place."""
        return self.launch(logits, requests).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, requests: Sequence[Request]) -> "PendingSamples":
        """The draws of ``requests`` from ``logits`` (S, V), queued on the logits'
        device: their token ids stay there for the next step's inputs, and their copy
        to the host is read by ``result()`` (the step's one device-to-host copy)."""
        logits = logits.float()
        errors: dict[int, str] = {}
        top_n = max((r.params.logprobs for r in requests if r.params.logprobs is not None),
                    default=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if top_n is not None else None
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

        if (self._c_kernels_take(logits) and top_n is None
                and all(r.params.greedy for r in requests)):
            both = self.kernels.greedy_pass(logits)  # tokens and codes, one pass
            return PendingSamples(both[0], lambda: list(zip(*both.tolist())), requests,
                                  top_n, errors)
        tokens, packed = self._draw(logits, requests, top_n, raw_logprobs)
        if packed.device.type != "cuda":
            return PendingSamples(tokens, packed.tolist, requests, top_n, errors)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read() -> list[list[float]]:
            copied.synchronize()
            return host.tolist()
        return PendingSamples(tokens, read, requests, top_n, errors)

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request], top_n: Optional[int],
              raw_logprobs: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token (S,) and, packed in one (S, K) float64 tensor for the host,
        its token, validity code, then its logprobs if any row wants them (the chosen
        token's, then top_n values and top_n ids)."""
        n = len(requests)
        codes = _row_codes(logits)  # every row, after its processing
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if len(greedy) == n:
            tokens = self.argmax(logits)
        else:
            tokens = torch.zeros(n, dtype=torch.int64, device=logits.device)
            if greedy:
                index = to_device(greedy, logits.device)
                tokens[index] = self.argmax(logits.index_select(0, index))
            index = to_device(sampled, logits.device)
            drawn, sampled_codes = self._sample(logits.index_select(0, index),
                                                [requests[i] for i in sampled])
            tokens[index] = drawn
            codes[index] = torch.maximum(codes[index], sampled_codes)

        columns = [tokens.double().unsqueeze(1), codes.double().unsqueeze(1)]
        if raw_logprobs is not None:
            columns.append(raw_logprobs.gather(1, tokens.unsqueeze(1)).double())
            if top_n:
                values, ids = torch.topk(raw_logprobs, top_n, dim=-1)
                columns += [values.double(), ids.double()]
        return tokens, torch.cat(columns, dim=1)

    def apply_grammars(self, logits: torch.Tensor, requests: list[Request], rows: list[int],
                       errors: dict[int, str]) -> None:
        """Every structured-output row's grammar mask, uploaded in one copy and
        applied in one operation. A grammar in error fails its row alone."""
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

    def _sample(self, logits: torch.Tensor, requests: list[Request]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(S', V) logits of sampled rows -> (S',) token ids and validity codes (the
        cut-offs cannot empty a row that had a finite maximum: each keeps the most
        likely token)."""
        probs, codes = distribution(logits, [r.params for r in requests])
        return exponential_race(probs, requests, self.generator), codes

    @torch.inference_mode()
    def profile(self, logits: Optional[torch.Tensor]) -> None:
        """Runs the costliest path (logprobs, top-k, top-p, min-p, a draw) on
        ``logits``, for the memory profile of a step."""
        if logits is None:
            return
        logits = logits.float()
        rows = logits.shape[0]
        raw = torch.log_softmax(logits, dim=-1)
        torch.topk(raw, 20, dim=-1)
        cut = apply_top_p(apply_top_k(logits, [logits.shape[1] // 2] * rows), [0.9] * rows)
        probs = apply_min_p(torch.softmax(cut, dim=-1), [0.05] * rows)
        (probs / torch.empty_like(probs).exponential_(generator=self.generator)).argmax(-1)


def distribution(logits: torch.Tensor, params: Sequence[SamplingParams]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled rows' logits (S, V) -> the distributions they are drawn from (divided by
    the temperature, cut by top_k, top_p and min_p) and each row's validity code."""
    temps = to_device([p.temperature for p in params], logits.device, torch.float32)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k is not None for p in params):
        logits = apply_top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, [p.top_p for p in params])
    codes = _row_codes(logits)  # a temperature can overflow a finite logit to inf
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = apply_min_p(probs, [p.min_p for p in params])
    return probs, codes


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.int64
              ) -> torch.Tensor:
    """A small tensor of ``values`` on ``device``, copied without waiting for the
    device: from pinned memory on CUDA (a copy from pageable memory would wait for
    every queued kernel, the step queued ahead's included)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _row_codes(logits: torch.Tensor) -> torch.Tensor:
    """(S,) validity code of each row (_ROW_ERRORS; 0: fine). NaN and +inf propagate
    through the maximum; all -inf leaves nothing to choose."""
    row_max = logits.amax(dim=-1)
    return torch.where(torch.isnan(row_max), 1, torch.where(
        row_max == float("inf"), 2, torch.where(row_max == float("-inf"), 3, 0)))


def exponential_race(probs: torch.Tensor, requests: Sequence[Request],
                     generator: torch.Generator) -> torch.Tensor:
    """(S, V) probabilities -> (S,) draws: argmax(p / E), E ~ Exp(1) per token. Seeded
    requests draw their row's E from their own generator."""
    noise = torch.empty_like(probs)
    shared = [j for j, r in enumerate(requests) if r.params.seed is None]
    if len(shared) == len(requests):
        noise.exponential_(generator=generator)
    else:
        if shared:
            index = to_device(shared, probs.device)
            noise.index_copy_(0, index, torch.empty(len(shared), probs.shape[1],
                                                    device=probs.device).exponential_(
                                                        generator=generator))
        for j, r in enumerate(requests):
            if r.params.seed is None:
                continue
            if r.generator is None:
                r.generator = torch.Generator(device=probs.device)
                r.generator.manual_seed(r.params.seed & 0xFFFF_FFFF_FFFF_FFFF)
                for _ in range(r.num_draws_elsewhere):  # made by a prefill engine
                    noise[j].exponential_(generator=r.generator)
            noise[j].exponential_(generator=r.generator)
    # E can round to 0: keep the quotient finite (a zero p stays 0).
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def process_logits(row: torch.Tensor, request: Request) -> None:
    """One request's own processing of its logits row (V,), in place: penalties, the
    stop-token ban before min_tokens, logit bias, the allowed and banned tokens, then
    its extra logits processors. (Grammars are applied to all rows at once after it:
    apply_grammars.)"""
    p = request.params
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        apply_penalties(row.unsqueeze(0), [request])
    if request.num_output_tokens < p.min_tokens and request.stop_ids:
        row.index_fill_(0, to_device(list(request.stop_ids), row.device), float("-inf"))
    if p.logit_bias:
        row.index_add_(0, to_device(list(p.logit_bias), row.device),
                       to_device(list(p.logit_bias.values()), row.device, row.dtype))
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[to_device(p.allowed_token_ids, row.device)] = True
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
    (logit - presence * [count > 0] - frequency * count). Counts live on each
    request's PenaltyState."""
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        p = r.params
        row = logits[i]
        if r.penalty_state is None:
            r.penalty_state = PenaltyState(r, vocab, logits.device)
        state = r.penalty_state
        state.update(r)
        if p.repetition_penalty != 1.0:
            penalized = torch.where(row > 0, row / p.repetition_penalty,
                                    row * p.repetition_penalty)
            row.copy_(torch.where(state.seen, penalized, row))
        if p.presence_penalty or p.frequency_penalty:
            counts = state.counts.to(logits.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_ks: list[Optional[int]]) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept)."""
    vocab = logits.shape[1]
    ks = [min(k, vocab) if k is not None else vocab for k in top_ks]
    kth = torch.topk(logits, max(ks), dim=-1).values  # (S, max_k), descending
    idx = to_device([k - 1 for k in ks], logits.device).unsqueeze(1)
    threshold = kth.gather(1, idx)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
    top_p = to_device(top_ps, logits.device, torch.float32).unsqueeze(1)
    drop_sorted = before >= top_p
    drop_sorted[:, 0] = False  # the most likely token, whatever top_p
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely token."""
    min_p = to_device(min_ps, probs.device, torch.float32).unsqueeze(1)
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
