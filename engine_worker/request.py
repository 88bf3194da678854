"""A request's mutable state inside the engine, built once from what add_request got."""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional, Sequence

import torch

from common.prefix_hash import salt_root
from common.protocol import FinishReason, SamplingParams, TokenLogprobs
from common.structured import GrammarMatcher
from engine_worker.block_manager import BlockTable
from common.ngram import Prediction


# The id held by a token sampled on the device and not yet seen by the host; never a
# model's input (the step reads the real id on the device).
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again for recompute
    RUNNING = "running"  # holds KV blocks; computing its prompt or decoding
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, eos_token_ids: frozenset[int],
                 grammar: Optional[GrammarMatcher] = None,
                 output_token_ids: Sequence[int] = (), lora_slot: int = 0,
                 adapter_key: Optional[str] = None) -> None:
        """``output_token_ids``: tokens generated for it elsewhere (a prefill engine);
        it continues after them. ``lora_slot``, ``adapter_key``: its LoRA adapter's
        slot and key (engine_worker/lora.py)."""
        self.request_id = request_id
        self.params = params
        # Prompt then generated tokens: the sequence whose KV the cache holds.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Speculation (speculation.py): proposed tokens at the end of token_ids, which
        # the step computing them checks (not yet known: never in the prefix cache),
        # and what the model generates after the known tokens and each proposed one,
        # from that step's logits.
        self.num_draft = 0
        self.draft_check: Optional[list[int]] = None
        # Most tokens it proposes next: one more than its last check kept (None: the
        # engine's K), so that a reply that stops following its text wastes little.
        self.draft_limit: Optional[int] = None
        # 1 while the newest token is a placeholder (PENDING_TOKEN): sampled on the
        # device, its id not yet on the host. The engine appends it to schedule the
        # request's next step before this one's tokens are read (engine.py, run-ahead).
        self.num_pending = 0
        # Resolved limit: params.max_tokens, or what the context has room for.
        self.max_tokens = max_tokens
        # Tokens that end generation with "stop" (empty with ignore_eos).
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids)
        # Extra per-request logits processing, each called as f(row (V,), request) and
        # allowed to modify the row in place (see sampler.py).
        self.logits_processors: list[Callable[[torch.Tensor, "Request"], None]] = []
        # The output's grammar (structured output): it masks every sample. With
        # structured_after it waits (``dormant``) until that token is generated.
        self.grammar = grammar
        # Its predicted output, where it gave one: speculation's proposals.
        self.prediction = Prediction(params.prediction) if params.prediction else None
        self.dormant: Optional[GrammarMatcher] = None
        if grammar is not None and params.structured_after is not None:
            self.grammar, self.dormant = None, grammar
        self._constrained = (params.repetition_penalty != 1.0 or bool(params.presence_penalty)
                             or bool(params.frequency_penalty) or bool(params.logit_bias)
                             or params.allowed_token_ids is not None
                             or bool(params.bad_words_ids) or grammar is not None)
        for token_id in output_token_ids:
            self.append_token(token_id)
        # Draws a seeded request made elsewhere: its generator skips them, so that its
        # output is what one engine would have sampled.
        self.num_draws_elsewhere = 0 if params.greedy else len(output_token_ids)
        # Prompt blocks received from a prefill engine (engine_worker/kv_transfer.py),
        # held until the request's admission attaches them.
        self.staged_blocks: Optional[BlockTable] = None
        # Prefill side: hold the prompt's blocks this long once finished.
        self.kv_lease_s = 0.0
        # Decode side: how its KV transfer ended, for its first output.
        self.kv_outcome: Optional[str] = None
        self.kv_blocks_received: Optional[int] = None
        self.kv_transfer_ms: Optional[float] = None
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        # Tokens whose KV is in the cache (or is written in the current step).
        self.num_computed_tokens = 0
        self.blocks = BlockTable(root=salt_root(params.cache_salt, adapter_key))
        # Its LoRA adapter's slot in the layers (0: none; engine_worker/lora.py)
        self.lora_slot = lora_slot
        # An embedding request: "last" or "mean" (the engine's pooling), and the pooled
        # final hidden states so far (mean: their sum; forward.py adds each step's)
        self.embed: Optional[str] = None
        self.pooled: Optional[torch.Tensor] = None
        self.pooled_upto = 0   # (positions pooled: a row is added once)
        # Prompt tokens served by the prefix cache at first admission.
        self.num_cached_tokens: Optional[int] = None
        self.num_preemptions = 0
        # Its place among requests of its priority (scheduler.WaitingQueue), from its
        # first arrival.
        self.arrival_seq: Optional[int] = None
        # The scheduler's step count when it last ran this request (turn-taking).
        self.last_scheduled_step = 0
        # With a seed, the sampler gives the request a private generator (on the
        # engine's device) so that its draws do not depend on the batch.
        self.generator: Optional[torch.Generator] = None
        # The sampler's device-side counts for penalties (sampler.PenaltyState).
        self.penalty_state = None
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.first_output_sent = False
        # prompt_logprobs: one entry per prompt token after the first, as computed.
        self.prompt_logprobs: list[TokenLogprobs] = []

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether the prompt's logits are still wanted (prompt_logprobs)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def computes_prompt(self) -> bool:
        """Whether every prompt token is computed, none read from the prefix cache
        or elsewhere: its logits are wanted (prompt_logprobs), or its hidden states'
        mean (an embedding's)."""
        return self.needs_prompt_logits or (self.embed == "mean" and
                                            self.num_computed_tokens < self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the sampler must run this request's own logits processing."""
        return (self._constrained or bool(self.logits_processors)
                or (self.num_output_tokens < self.params.min_tokens and bool(self.stop_ids)))

    @property
    def runs_ahead(self) -> bool:
        """Whether its next step may be scheduled before its newest token is known:
        nothing that samples it reads its tokens (penalties, bad words, a grammar,
        or one waiting for its token, extra logits processors), and no KV lease holds
        its blocks once it ends."""
        p = self.params
        return (self.grammar is None and self.dormant is None and not self.logits_processors
                and not p.bad_words_ids
                and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty and not self.kv_lease_s)

    def draft_room(self, max_model_len: int) -> int:
        """How many tokens it may propose this step: none when it is seeded and
        sampled, has sampling that reads its tokens, or wants logprobs; no more than
        its output and the context have room for after the next token."""
        p = self.params
        if ((p.seed is not None and not p.greedy) or self.needs_logits_processing
                or p.logprobs is not None or self.num_pending or self.kv_lease_s
                or self.dormant is not None):
            return 0
        return max(0, min(self.max_tokens - self.num_output_tokens,
                          max_model_len - self.num_tokens) - 1)

    def drop_draft(self) -> list[int]:
        """Take its proposed tokens off (checked, or never computed); returns them."""
        cut = len(self.token_ids) - self.num_draft
        draft = self.token_ids[cut:]
        del self.token_ids[cut:]
        self.num_draft, self.draft_check = 0, None
        return draft

    def ends_after_next_token(self, max_model_len: int) -> bool:
        """Whether the token being sampled ends it by length, whatever it is."""
        return (self.num_output_tokens + 1 >= self.max_tokens
                or self.num_tokens + 1 >= max_model_len)

    def hold_place(self) -> None:
        """A placeholder for the token being sampled (see num_pending)."""
        assert not self.num_pending
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending = 1

    def append_token(self, token_id: int) -> None:
        """The sampled token: fills the placeholder if one holds its place."""
        if self.num_pending:
            self.token_ids[-1] = token_id
            self.num_pending = 0
        else:
            self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.consume(token_id)
        elif self.dormant is not None and self._woken():
            self.grammar, self.dormant = self.dormant, None  # from the next token on

    def _woken(self) -> bool:
        """Whether the output now ends with structured_after's ids."""
        after = self.params.structured_after
        return (self.token_ids[-1] == after[-1] and self.num_output_tokens >= len(after)
                and self.token_ids[-len(after):] == after)

    def check_stop(self, max_model_len: int) -> Optional[FinishReason]:
        """Why generation ends after the newest token, if it does."""
        last = self.token_ids[-1]
        if last in self.stop_ids and self.num_output_tokens >= self.params.min_tokens:
            return FinishReason.STOP
        if self.grammar is not None and self.grammar.done:
            return FinishReason.STOP  # the output is complete; no stop token
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    @property
    def stop_token_id(self) -> Optional[int]:
        """After a STOP: the token that caused it (None when the grammar completed)."""
        last = self.token_ids[-1]
        return last if last in self.stop_ids else None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
