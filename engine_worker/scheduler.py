"""Continuous batching under a token budget, with chunked prefill and preemption.

Model: every step computes, for each scheduled request, the next tokens whose KV is
not yet in the cache: one token for a decoding request, a chunk of the prompt for one
still prefilling. A step's tokens are capped by the token budget; a prompt longer than
what is left of the budget is split over several steps (chunked prefill).

Order of service each step:
  1. running requests that decode (one token each), at most max_batch_size of them,
     by priority (SamplingParams.priority, lower first), then least recently served
     first; then running requests that are still prefilling, by priority, then in
     admission order. When the KV pool cannot give a request its next block, the
     running request not yet scheduled this step with the highest priority value,
     the most recently admitted of those, is preempted: its blocks are released
     (hashed ones stay in the prefix cache) and it goes back to the queue, in its
     place, to be recomputed later. Nothing is corrupted and nothing is dropped.
     With speculation a decoding request may compute tokens it proposes (engine's
     drafter, speculation.py) after its own, within the step's row limit, from the
     budget the decodes after it do not need, and only where free blocks hold them.
  2. waiting requests, in order of priority (SamplingParams.priority, lower first),
     then of arrival (a preempted request keeps its place), while fewer than
     max(max_batch_size, prefill_max_batch_size) requests run, this step's admissions
     are under prefill_max_batch_size, the budget lasts, and no running request was
     preempted for blocks this step. An admitted request first attaches the blocks the
     prefix cache holds for its prompt, then those the tiers below the pool hold
     (kv_offload.py: copied back), and computes only the rest.

Before both, priority preempts: a waiting request that finds no room (the running
set full, or too few blocks for its first chunk) while running requests have higher
priority values is given theirs, the highest values first (vLLM's priority
scheduling); requests of its own value or lower are never preempted for it.

The two knobs are decoupled (seed 004): with prefill_max_batch_size above
max_batch_size, a burst is admitted and prefilled at once (every request gets its
first token early) and then decodes max_batch_size requests per step, in turns.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from common.config import SchedulerConfig
from engine_worker.block_manager import BlockManager, BlockTable
from engine_worker.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    # Tokens computed for it this step, starting at its num_computed_tokens.
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of its known tokens (and so yields a token)."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    # In the order they were scheduled: running requests, then admissions. A request
    # may attend to blocks an earlier one fills in the same step (in-batch dedup),
    # never to a later one's.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted in this step (now waiting again).
    preempted: list[Request] = field(default_factory=list)


class WaitingQueue:
    """Waiting requests, the first to admit first: by priority, then by arrival (a
    request's first arrival: one preempted and queued again keeps its place)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._arrivals = itertools.count()

    def add(self, request: Request) -> None:
        if request.arrival_seq is None:
            request.arrival_seq = next(self._arrivals)
        heapq.heappush(self._heap, (request.params.priority, request.arrival_seq, request))

    def first(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (entry[2] for entry in self._heap)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        """config: resolved for the device (SchedulerConfig.for_device)."""
        self.config = config
        self.block_manager = block_manager
        self.token_budget = config.token_budget
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.num_steps = 0
        self.max_running = max(config.decode_batch_size, config.prefill_batch_size)
        # Speculation: (request, most tokens) -> the tokens it proposes this step.
        self.drafter: Optional[Callable[[Request, int], list[int]]] = None
        # ... while a step's decodes and proposals stay within this many rows.
        self.max_step_rows = 0
        # The KV tiers below the pool (kv_offload.py): (request, its cached block ids)
        # -> a table holding the prompt blocks after those copied back into the pool,
        # or None.
        self.onload: Optional[Callable[[Request, list[int]], Optional[BlockTable]]] = None

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        budget = self.token_budget
        scheduled_ids: set[str] = set()
        self._make_room_by_priority(out)
        preempted_before = len(out.preempted)
        # Decodes first (a long prefill chunk must not starve them of budget), by
        # priority, then the least recently served first, at most a decode batch of
        # them; then prefills by priority, then in admission order.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        decodes.sort(key=lambda r: (r.params.priority, r.last_scheduled_step))
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        prefills.sort(key=lambda r: r.params.priority)
        decodes = decodes[:self.config.decode_batch_size]
        order = decodes + prefills
        # Speculation: the proposals a step may still take (see speculation.py).
        draft_rows = max(0, self.max_step_rows - len(decodes))
        for position, request in enumerate(order):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            # sliding layers' blocks behind every query to come go (window_blocks.py)
            self.block_manager.slide(request.blocks, request.num_computed_tokens)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if position < len(decodes) and self.drafter is not None:
                # proposals take no budget the decodes after it need
                most = min(budget - (len(decodes) - position), draft_rows)
                if most > 0:
                    drafted = self._draft(request, most)
                    num_new += drafted
                    draft_rows -= drafted
            target = request.num_computed_tokens + num_new
            while not self.block_manager.allocate(request.blocks, request.token_ids, target,
                                                  num_known=request.num_tokens
                                                  - request.num_pending - request.num_draft):
                victim = self._pick_victim(scheduled_ids)
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new

        if len(out.preempted) == preempted_before:  # the pool is not short
            budget = self._admit(out, budget)
        now = time.monotonic()
        for s in out.scheduled:
            s.request.last_scheduled_step = self.num_steps
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        admitted = 0
        while (self.waiting and budget > 0
               and len(self.running) < self.max_running
               and admitted < self.config.prefill_batch_size):
            request = self.waiting.first()
            # A request that wants its prompt's logprobs computes the prompt (their
            # logits are not cached) until it has them.
            cached = ([] if request.computes_prompt else
                      self.block_manager.find_cached_prefix(request.blocks, request.token_ids))
            onloaded = None
            if self.onload is not None and not request.computes_prompt:
                onloaded = self.onload(request, cached)
                if onloaded is not None:  # now in the pool: found there
                    cached = self.block_manager.find_cached_prefix(request.blocks,
                                                                   request.token_ids)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            allocated = self.block_manager.allocate(request.blocks, request.token_ids,
                                                    num_cached + num_new, cached,
                                                    request.num_tokens - request.num_pending)
            if onloaded is not None:  # attached, or cached in the pool for the next try
                self.block_manager.free(onloaded)
            if not allocated:
                # Blocks other waiting requests hold (received for them: kv_transfer.py)
                # go back to the cache first: they must never keep the first in line
                # out (with nothing running, nothing else would free any).
                if self._release_staged_of_others(request):
                    continue
                break  # the pool is full; running requests free blocks as they finish
            self.waiting.pop()
            self._release_staged(request)
            if request.num_cached_tokens is None:  # first admission, not a recompute
                request.num_cached_tokens = num_cached
                if not request.computes_prompt:  # looked up
                    self.prefix_cache_query_tokens += request.num_prompt_tokens
                    self.prefix_cache_hit_tokens += num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            admitted += 1
        return budget

    def _draft(self, request: Request, most: int) -> int:
        """A decoding request's proposed tokens, appended to it when the blocks they
        need are free (they never cost another request its place): how many."""
        assert self.drafter is not None
        draft = self.drafter(request, most)
        if not draft:
            return 0
        known = request.num_tokens - request.num_pending
        request.token_ids.extend(draft)
        if not self.block_manager.allocate(request.blocks, request.token_ids,
                                           request.num_tokens, num_known=known):
            del request.token_ids[known:]
            return 0
        request.num_draft = len(draft)
        return len(draft)

    def _make_room_by_priority(self, out: SchedulerOutput) -> None:
        """The first waiting request, when it cannot be admitted for lack of room (a
        full running set or KV pool) and running requests have higher priority values
        than its own, takes their room: they are preempted, the highest value and the
        most recently admitted first, as many as its first chunk needs, and only when
        that is enough. Done before anything is scheduled, so nothing of this step is
        undone."""
        if not self.waiting or not self.running:
            return
        first = self.waiting.first()
        victims = [r for _, _, r in sorted(
            ((r.params.priority, i, r) for i, r in enumerate(self.running)
             if r.params.priority > first.params.priority), reverse=True)]
        if not victims:
            return
        cached = ([] if first.computes_prompt else
                  self.block_manager.find_cached_prefix(first.blocks, first.token_ids))
        target = min(first.num_tokens,
                     len(cached) * self.block_manager.block_size + self.token_budget)
        needed = self.block_manager.num_blocks_needed(first.blocks, target, cached)
        free, running = self.block_manager.num_free_blocks, len(self.running)
        taken = 0
        while running > self.max_running - 1 or needed > free:
            if taken == len(victims):
                return  # not enough room even then: nothing is preempted for it
            table = victims[taken].blocks  # (its released entries hold nothing)
            free += sum(1 for b in table.block_ids[table.released:]
                        if self.block_manager.blocks[b].ref_count == 1)
            running -= 1
            taken += 1
        for victim in victims[:taken]:
            self.preempt(victim)
            out.preempted.append(victim)

    def _pick_victim(self, scheduled_ids: set[str]) -> Request:
        """Of the running requests not yet scheduled this step, the most recently
        admitted of the highest priority value."""
        candidates = [(r.params.priority, i, r) for i, r in enumerate(self.running)
                      if r.request_id not in scheduled_ids]
        if not candidates:
            raise AssertionError("no request left to preempt")
        return max(candidates, key=lambda c: c[:2])[2]

    def preempt(self, request: Request) -> None:
        """Release a running request's blocks and queue it again (in its place), to be
        recomputed."""
        self.block_manager.free(request.blocks)
        self.running.remove(request)
        request.drop_draft()
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's blocks and forget it."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.block_manager.free(request.blocks)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release_staged(request)
        request.status = RequestStatus.FINISHED

    def _release_staged_of_others(self, first: Request) -> bool:
        """Let go of the blocks held for waiting requests other than ``first`` (they
        stay in the prefix cache while nothing else needs their room); whether any
        were held."""
        holders = [r for r in self.waiting if r is not first and r.staged_blocks is not None]
        for request in holders:
            self._release_staged(request)
        return bool(holders)

    def _release_staged(self, request: Request) -> None:
        """Blocks received for the request (kv_transfer.py) were attached by its
        admission, or are no longer needed: the transfer's references go."""
        if request.staged_blocks is not None:
            self.block_manager.free(request.staged_blocks)
            request.staged_blocks = None
