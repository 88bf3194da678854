"""The in-process engine: add requests, step, abort, stats. Token ids only.

The engine worker process (engine_worker/server.py) wraps this class; tests and the
in-process benchmark drive it directly. Not thread-safe: one caller steps it.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional, Sequence

import torch

from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.model_files import resolve_model_dir
from common.protocol import EngineStats, FinishReason, RequestOutput, SamplingParams
from engine_worker.block_manager import BlockManager
from engine_worker.model_config import load_model_config
from engine_worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from engine_worker.request import Request, RequestStatus
from engine_worker.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = load_model_config(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.runner = ModelRunner(self.model_config, self.model_dir, config.cache,
                                  self.device, self.dtype, config.seed, config.cpu_kernels)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        # A request must fit in the pool on its own, or it could never finish.
        pool_tokens = self.runner.num_blocks * config.cache.block_size
        self.max_model_len = min(self.model_config.max_model_len, pool_tokens,
                                 config.max_model_len or self.model_config.max_model_len)
        if self.max_model_len < self.model_config.max_model_len:
            logger.info("context capped at %d tokens (model: %d, KV pool: %d)",
                        self.max_model_len, self.model_config.max_model_len, pool_tokens)
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   config.scheduler.token_budget(self.device.type))
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        logger.info("engine ready: %s (%s, %s, %s), context %d, %d KV blocks",
                    self.model_config.name, self.model_config.family, self.device,
                    self.dtype, self.max_model_len, self.runner.num_blocks)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def model_name(self) -> str:
        return self.model_config.name

    # -- requests --------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: Optional[SamplingParams] = None) -> None:
        """Queue a request. Raises InvalidRequestError (nothing queued) if it cannot be
        served as asked."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      "request_id")
        params.validate()
        prompt = list(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            prompt = prompt[-params.truncate_prompt_tokens:]
        if not prompt:
            raise InvalidRequestError("the prompt is empty; it needs at least one token",
                                      "prompt")
        self._check_token_ids(prompt, "prompt")
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        room = self.max_model_len - len(prompt)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the model's context of {self.max_model_len} tokens", "max_tokens")
        if room < 1:
            raise InvalidRequestError(
                f"the prompt ({len(prompt)} tokens) leaves no room to generate in the "
                f"model's context of {self.max_model_len} tokens", "prompt")
        request = Request(request_id, prompt, params, params.max_tokens or room,
                          self.eos_token_ids)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        vocab = self.vocab_size
        for token_id in token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < vocab:
                raise InvalidRequestError(
                    f"{param} has token id {token_id!r} outside the vocabulary "
                    f"[0, {vocab})", param)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop requests and free their blocks. Returns the ids that were active."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            self.scheduler.finish(request)
            request.finish_reason = FinishReason.ABORT
            aborted.append(request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- stepping --------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns an output for every request with news: a new token,
        or the end."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        try:
            token_ids, logprobs = self.runner.execute(plan.scheduled)
        except Exception as e:  # a failed batch fails its requests, not the engine
            logger.exception("step failed for %d request(s)", len(plan.scheduled))
            # Blocks registered this step may hold garbage: forget all cached prefixes.
            return self._fail([s.request for s in plan.scheduled], f"engine step failed: {e}")

        now = time.monotonic()
        outputs: list[RequestOutput] = []
        sampled = iter(zip(token_ids, logprobs))
        for s in plan.scheduled:
            request = s.request
            samples = s.samples
            start = request.num_computed_tokens
            request.num_computed_tokens += s.num_tokens
            self.num_prompt_tokens_computed += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - start)
            if not samples:
                continue
            token_id, token_logprobs = next(sampled)
            request.append_token(token_id)
            self.num_generated_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                request.finish_reason = reason
                self.scheduler.finish(request)
                del self.requests[request.request_id]
            outputs.append(self._output(request, [token_id],
                                        None if token_logprobs is None else [token_logprobs]))
        return outputs

    def _output(self, request: Request, new_token_ids: list[int],
                logprobs: Optional[list], error: Optional[str] = None) -> RequestOutput:
        first = not request.first_output_sent
        request.first_output_sent = True
        queue_ms = prefill_ms = None
        if first and request.first_scheduled_time is not None:
            queue_ms = (request.first_scheduled_time - request.arrival_time) * 1e3
            if request.first_token_time is not None:
                prefill_ms = (request.first_token_time - request.first_scheduled_time) * 1e3
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            error=error,
            num_cached_tokens=request.num_cached_tokens if first else None,
            queue_ms=queue_ms,
            prefill_ms=prefill_ms,
        )

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        outputs = []
        for request in requests:
            if request.status is RequestStatus.FINISHED:
                continue
            self.scheduler.finish(request)
            self.requests.pop(request.request_id, None)
            request.finish_reason = FinishReason.ERROR
            outputs.append(self._output(request, [], None, error=message))
        self.block_manager.reset_prefix_cache()
        return outputs

    # -- introspection ---------------------------------------------------------

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_cached=bm.num_cached_blocks,
            prefix_cache_query_tokens=sched.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=sched.prefix_cache_hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
        )

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Optional[SamplingParams] = None) -> list[list[int]]:
        """Run prompts to completion; their generated token ids, in order. A
        convenience for tests, benchmarks and the demo."""
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        results: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in results:
                    if out.finish_reason is FinishReason.ERROR:
                        raise RuntimeError(out.error)
                    results[out.request_id].extend(out.new_token_ids)
        return [results[request_id] for request_id in ids]
