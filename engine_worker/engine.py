"""The in-process engine: add requests, step, abort, stats. Token ids only.

The engine worker process (engine_worker/server.py) wraps this class; tests and the
in-process benchmark drive it directly. Not thread-safe: one caller steps it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Iterable, Optional, Sequence

import msgspec
import torch

from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.model_files import resolve_model_dir, weights_fingerprint
from common.protocol import (EngineStats, FinishReason, KvSource, RequestOutput,
                             SamplingParams, TokenLogprobs)
from common.structured import GrammarCompiler
from common.validation import check_token_ids, checked_prompt
from engine_worker.block_manager import BlockManager
from engine_worker.forward import unit_vector
from engine_worker.kv_paths import KvPaths
from engine_worker.lora import AdapterError, Adapters
from engine_worker.model_runner import ModelRunner
from engine_worker.models.registry import architecture, load_model_config
from engine_worker.platform import make_platform
from engine_worker.request import Request, RequestStatus
from engine_worker.sampler import PendingSamples, Samples, token_logprobs
from engine_worker.scheduler import ScheduledRequest, Scheduler
from engine_worker.speculation import PREDICTED_TOKENS, Speculator, max_step_rows
from engine_worker.step_failures import (FatalDeviceError, forward_one_by_one, raise_if_fatal,
                                         sample_one_by_one)
from engine_worker.window_blocks import SlidingBlockManager, WindowedBlockManager

logger = logging.getLogger(__name__)

class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = load_model_config(self.model_dir, config.max_model_len)
        if config.tensor_parallel_size > 1:   # (a split engine's steps are eager)
            config = dataclasses.replace(config, enforce_eager=True)
        # the device and its kernels, chosen once (platform.py)
        self.platform = make_platform(config)
        self.device = self.platform.device
        scheduler_config = config.scheduler.for_device(self.device.type)
        self.runner = ModelRunner(self.model_config, self.model_dir, config, scheduler_config,
                                  self.platform)
        cache, runner = config.cache, self.runner
        # sliding layers' blocks let go of as the window passes (window_blocks.py)
        if runner.windowed:  # in a pool of their own
            self.block_manager = WindowedBlockManager(
                runner.num_blocks, runner.num_local_blocks, cache.block_size, runner.window,
                cache.enable_prefix_caching)
        elif runner.sliding:  # every layer's, in the one pool
            self.block_manager = SlidingBlockManager(
                runner.num_blocks, cache.block_size, runner.window, cache.enable_prefix_caching)
        else:
            self.block_manager = BlockManager(runner.num_blocks, cache.block_size,
                                              cache.enable_prefix_caching)
        # A request must fit in the pool on its own, or it could never finish.
        pool_tokens = self.block_manager.longest_context(scheduler_config.token_budget)
        self.max_model_len = min(self.model_config.max_model_len, pool_tokens,
                                 config.max_model_len or self.model_config.max_model_len)
        if self.max_model_len < self.model_config.max_model_len:
            logger.info("context capped at %d tokens (model: %d, KV pool: %d)",
                        self.max_model_len, self.model_config.max_model_len, pool_tokens)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        # LoRA adapters, applied by the layers they target to their requests' rows
        self.adapters = Adapters(runner.model, architecture(self.model_config.architecture),
                                 self.model_config.checkpoint_prefixes, config.max_loras,
                                 config.max_lora_rank, self.device, runner.dtype,
                                 split=runner.parallel.size > 1)
        runner.use_lora(self.adapters.context)
        for name, path in config.lora_modules:
            try:
                self.adapters.load(name, path)
            except AdapterError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from e
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        # KV from and to elsewhere: P/D transfers, the tiers below the pool, the KV
        # store (kv_paths.py); their blocks' layout names the weights.
        weights = weights_fingerprint(self.model_dir, config.load_format, config.seed)
        split = runner.parallel
        self.kv = KvPaths(config, runner, self.block_manager, self.scheduler,
                          f"{self.model_config.kv_signature}|"
                          f"weights={runner.weight_format}:{weights}"
                          + (f"|rank={split.rank}/{split.size}" if split.size > 1 else ""))
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        # (split over ranks: a step's ids are all on the host, for the other ranks)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.platform.runs_ahead and split.size == 1)
        # The step queued ahead whose tokens the host has not read yet (step()), and
        # how many steps were queued while the one before was in flight.
        self._inflight: Optional[_Step] = None
        self.num_steps_ahead = 0
        # Speculation (speculation.py): with --speculative-tokens K, every decoding
        # request's n-gram proposals; without it, on the CPU engine, a request's that
        # carries a prediction (OpenAI's predicted output), its prediction's.
        self.speculator: Optional[Speculator] = None
        k = config.speculative_tokens
        if k and (not self.platform.speculates or self.async_scheduling):
            raise ValueError("speculative tokens run on the CPU engine, without async "
                             "scheduling")
        if k or (self.platform.speculates and not self.async_scheduling):
            self.speculator = Speculator(k or PREDICTED_TOKENS, self.max_model_len,
                                         self.runner.sampler.generator, own_text=bool(k))
            self.scheduler.drafter = self.speculator.propose
            self.scheduler.max_step_rows = max_step_rows(self.runner.weight_format)
        logger.info("engine ready: %s (%s, %s, %s weights), context %d, %d KV blocks",
                    self.model_config.name, self.model_config.architecture, self.device,
                    self.runner.weight_format,
                    self.max_model_len, self.runner.num_blocks)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output's grammars, over the model's tokenizer (built on first
        use: about a second for a 50k vocabulary; the worker process builds it at
        start)."""
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise InvalidRequestError(f"structured output needs the model's tokenizer.json, "
                                      f"which {self.model_dir} does not have", "response_format")
        from tokenizers import Tokenizer

        try:
            return GrammarCompiler(Tokenizer.from_file(str(path)), self.vocab_size,
                                   sorted(self.eos_token_ids))
        except Exception as e:  # a tokenizer llguidance cannot read
            raise InvalidRequestError(f"structured output is unavailable for this model's "
                                      f"tokenizer: {e}", "response_format") from e

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def model_name(self) -> str:
        return self.model_config.name

    # -- requests --------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: Optional[SamplingParams] = None, *,
                    output_token_ids: Sequence[int] = (), kv_lease_s: float = 0.0,
                    kv_source: Optional[KvSource] = None) -> None:
        """Queue a request. Raises InvalidRequestError (nothing queued) if it cannot be
        served as asked. Disaggregated serving (AddRequest in common/protocol.py):
        ``output_token_ids`` were generated elsewhere and the request continues after
        them; ``kv_lease_s`` keeps its prompt's blocks for a decode engine once it
        ends; ``kv_source`` is where to pull its prompt's blocks from first."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      "request_id")
        prompt = checked_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        if params.embed and (output_token_ids or kv_lease_s or kv_source is not None
                             or params.structured is not None or params.prompt_logprobs
                             is not None):
            raise InvalidRequestError("an embedding request takes a prompt alone (no "
                                      "continuation, KV transfer, structured output or "
                                      "prompt logprobs)", "embed")
        _check_continuation(prompt, output_token_ids, params, self.vocab_size,
                            self.max_model_len, kv_lease_s)
        if self.runner.parallel.size > 1 and (kv_lease_s or kv_source is not None):
            raise InvalidRequestError(
                "this engine's model is split over tensor-parallel ranks, whose KV is not "
                "moved between engines yet", "kv_source" if kv_source else "kv_lease_s")
        if self.runner.window and kv_lease_s:
            raise InvalidRequestError(
                "this engine lets go of its sliding-window layers' blocks as the window "
                "passes and cannot lend a prompt's KV to another engine (start it with "
                "--role prefill)", "kv_lease_s")
        room = self.max_model_len - len(prompt)
        grammar = None
        if params.structured is not None:
            grammar = self.grammars.matcher(params.structured)  # InvalidRequestError
        adapter = None
        if params.adapter is not None:   # (InvalidRequestError: no such adapter)
            adapter = self.adapters.acquire(params.adapter)
        request = Request(request_id, prompt, params, params.max_tokens or room,
                          self.eos_token_ids, grammar, output_token_ids,
                          adapter.slot if adapter else 0, adapter.key if adapter else None)
        if params.embed:
            request.embed = self.config.pooling
        request.kv_lease_s = kv_lease_s
        self.requests[request_id] = request
        self.runner.num_special += bool(request.lora_slot or request.embed)
        if not self.kv.start(request, kv_source, time.monotonic()):
            self.scheduler.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop requests and free their blocks. Returns the ids that were active."""
        aborted = []
        for request_id in request_ids:
            # (a finished prefill's lease ends too: the decode engine will not come)
            waiting = self.kv.abort(request_id)
            request = self._forget(request_id)
            if request is None:
                continue
            if waiting:
                request.status = RequestStatus.FINISHED
            else:
                self.scheduler.finish(request)
            request.finish_reason = FinishReason.ABORT
            aborted.append(request_id)
        return aborted

    def _forget(self, request_id: str) -> Optional[Request]:
        """A request that ended, no longer the engine's (its adapter let go of)."""
        request = self.requests.pop(request_id, None)
        if request is not None and (request.lora_slot or request.embed):
            self.runner.num_special -= 1
            if request.lora_slot:
                self.adapters.release(request.lora_slot)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_steps_to_run(self) -> bool:
        """Whether step() has anything to compute or a step in flight to finish
        (requests waiting only for their KV to arrive do not count)."""
        return bool(self._inflight or self.scheduler.running or self.scheduler.waiting)

    # -- stepping --------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns an output for every request with news: a new token,
        or the end.

        Run-ahead (``async_scheduling``, on with CUDA): a step's tokens stay on the
        device while the next step is scheduled and queued behind it, its inputs
        reading them there (each request that goes on holds a placeholder for its
        token); then the host reads the first step's tokens and finishes it, while the
        device computes the next. The device never waits for the host's scheduling and
        bookkeeping, and step() returns the outputs of the step before the one it
        queued. A step runs ahead only when no request in it has sampling that reads
        its tokens (Request.runs_ahead); otherwise it is finished before the next is
        scheduled. A request that ends on the token it was waiting for wastes its row
        of the queued step; one preempted while its token is pending gets the token
        when the step is finished and is recomputed with it. Outputs are the same
        either way.

        One request's failure is its own: a request whose logits or sampling go bad,
        or whose post-processing raises, ends with finish reason "error" and the others
        go on. When the batch's forward pass itself raises, every request is run alone
        to find the one(s) that fail (step_failures.forward_one_by_one); the prefix cache keeps
        everything that is known good."""
        inflight, self._inflight = self._inflight, None
        self.runner.prompt_logits = []  # this call's, if it runs a forward pass
        self.kv.poll()
        outputs: list[RequestOutput] = []
        if inflight is not None and self._may_run_ahead(inflight):
            self._hold_places(inflight)
            plan = self.scheduler.schedule()
            launched = self._launch(plan.scheduled, after=inflight) if plan.scheduled else None
            outputs = self._finish(inflight)
            if launched is not None:
                self._inflight = launched
                self.num_steps_ahead += 1
            return outputs
        if inflight is not None:
            outputs = self._finish(inflight)
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return outputs
        launched = self._launch(plan.scheduled)
        if self.async_scheduling and self._may_run_ahead(launched):
            self._inflight = launched
            return outputs
        return outputs + self._finish(launched)

    def _may_run_ahead(self, step: "_Step") -> bool:
        """Whether the next step may be scheduled before ``step``'s tokens are known."""
        return not step.finished and all(r.runs_ahead for r in step.sampling)

    def _hold_places(self, step: "_Step") -> None:
        """A placeholder token for each request of ``step`` that goes on for sure
        (it may still stop on its token; it cannot end by length)."""
        for request in step.sampling:
            if (request.status is RequestStatus.RUNNING
                    and not request.ends_after_next_token(self.max_model_len)):
                request.hold_place()

    def _launch(self, scheduled: list[ScheduledRequest], after: Optional["_Step"] = None
                ) -> "_Step":
        """Queue a step's forward pass and sampling, and count its tokens as computed.
        ``after``: the step still in flight whose tokens fill this one's placeholders."""
        early: list[RequestOutput] = []
        try:
            if after is None:
                logits = self.runner.forward(scheduled)
            else:
                logits = self.runner.forward(scheduled, after.tokens())
            self._record_logits()
        except Exception as e:
            raise_if_fatal(e)
            if self.runner.parallel.size > 1:   # (its ranks may be inside another step)
                raise FatalDeviceError(f"a step failed on rank 0 of a model split over "
                                       f"tensor-parallel ranks, which cannot stay in step: "
                                       f"{type(e).__name__}: {e}") from e
            logger.exception("the forward pass failed for %d request(s); running them one "
                             "by one", len(scheduled))
            if after is not None:  # its tokens first: they fill the placeholders
                early = self._finish(after)
                scheduled = [s for s in scheduled if s.request.status is RequestStatus.RUNNING]
            scheduled, logits, failures = forward_one_by_one(self, scheduled)
            early += failures
        sampling = [s.request for s in scheduled if s.samples]
        embedded = [r for r in sampling if r.embed is not None]
        if embedded:   # (pooled, not sampled: their rows of the logits are dropped)
            keep = [i for i, r in enumerate(sampling) if r.embed is None]
            sampling = [sampling[i] for i in keep]
            logits = logits[keep] if keep and logits is not None else None
        for s in scheduled:
            request = s.request
            start = request.num_computed_tokens
            request.num_computed_tokens += s.num_tokens
            self.num_prompt_tokens_computed += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - start)
        early += [self._embedded(r) for r in embedded]
        return _Step(sampling, self._sample(logits, sampling), early)

    def _embedded(self, request: Request) -> RequestOutput:
        """An embedding request whose prompt is computed: its vector (forward.py)
        and its end (its blocks stay in the prefix cache, as any prompt's: an
        embedding of the same text again, with last-token pooling, or a generation on
        it, reads them)."""
        vector = unit_vector(request.pooled)
        if vector is None:
            return self._fail(request, "the embedding is not finite")
        request.finish_reason = FinishReason.STOP
        self.scheduler.finish(request)
        self._forget(request.request_id)
        return msgspec.structs.replace(self._output(request, [], None), embedding=vector)

    def _finish(self, step: "_Step") -> list[RequestOutput]:
        """Wait for a step's tokens and hand them to its requests (once)."""
        if step.finished:
            return []
        step.finished = True
        outputs = step.early_outputs
        samples = self._read_samples(step)
        now = time.monotonic()
        for i, request in enumerate(step.sampling):
            if request.status is RequestStatus.FINISHED:
                continue  # ended (or was aborted) after the step was queued
            if i in samples.errors:
                outputs.append(self._fail(request, samples.errors[i]))
                continue
            try:
                if request.num_draft:
                    assert self.speculator is not None
                    tokens = self.speculator.checked(request, samples.token_ids[i])
                    outputs.append(self._advance(request, tokens, None, now) if tokens
                                   else self._fail(request, "sampling failed: the logits "
                                                            "are not finite"))
                    continue
                outputs.append(self._advance(request, [samples.token_ids[i]],
                                             samples.logprobs[i], now))
            except Exception as e:  # a bug this request hit: its failure alone
                logger.exception("finishing the step failed for %s", request.request_id)
                outputs.append(self._fail(request, f"internal error: {type(e).__name__}: {e}"))
        return outputs

    def _advance(self, request: Request, token_ids: list[int],
                 logprobs: Optional[TokenLogprobs], now: float) -> RequestOutput:
        """Append a sampled token (or kept proposals and the token after them, each
        but the last computed); finish the request if it ends on one of them."""
        added: list[int] = []
        for token_id in token_ids:
            if added:
                request.num_computed_tokens += 1
            request.append_token(token_id)
            added.append(token_id)
            self.num_generated_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                request.finish_reason = reason
                self.kv.finished(request, now)
                self.scheduler.finish(request)
                self._forget(request.request_id)
                break
        return self._output(request, added, None if logprobs is None else [logprobs])

    def _record_logits(self) -> None:
        """What the last forward computed besides the samples: the logprobs of prompt
        tokens, and the check of proposed tokens (speculation)."""
        if self.speculator is not None:
            self.speculator.record(self.runner.draft_logits)
        for request, first, logits in self.runner.prompt_logits:
            request.prompt_logprobs.extend(token_logprobs(
                torch.log_softmax(logits.float(), dim=-1),
                request.token_ids[first + 1:first + 1 + len(logits)],
                request.params.prompt_logprobs))

    def _sample(self, logits: Optional[torch.Tensor], requests: list[Request]
                ) -> PendingSamples:
        if not requests:
            return PendingSamples.ready(Samples([], []), self.device)
        assert logits is not None
        try:
            return self.runner.sampler.launch(logits, requests)
        except Exception as e:  # the sampler isolates rows itself; this is a last resort
            raise_if_fatal(e)
            logger.exception("sampling failed for %d request(s); sampling them one by one",
                             len(requests))
        return PendingSamples.ready(sample_one_by_one(self.runner.sampler, logits, requests),
                                    self.device)

    def _read_samples(self, step: "_Step") -> Samples:
        try:
            return step.pending.result()
        except Exception as e:  # reading the draws back failed: the step's rows fail
            raise_if_fatal(e)
            logger.exception("reading the samples of %d request(s) failed", len(step.sampling))
            message = f"sampling failed: {type(e).__name__}: {e}"
            return Samples([None] * len(step.sampling), [None] * len(step.sampling),
                           {i: message for i in range(len(step.sampling))})

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
            stop_token_id=(request.stop_token_id if request.finish_reason is FinishReason.STOP
                           else None),
            error=error,
            num_cached_tokens=request.num_cached_tokens if first else None,
            prompt_logprobs=(request.prompt_logprobs if first and
                             request.params.prompt_logprobs is not None else None),
            queue_ms=queue_ms,
            prefill_ms=prefill_ms,
            kv_outcome=request.kv_outcome if first else None,
            kv_blocks_received=request.kv_blocks_received if first else None,
            kv_transfer_ms=request.kv_transfer_ms if first else None,
        )

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """End one request with finish reason "error"."""
        self.scheduler.finish(request)
        self._forget(request.request_id)
        request.finish_reason = FinishReason.ERROR
        return self._output(request, [], None, error=message)

    # -- introspection ---------------------------------------------------------

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        local = getattr(bm, "local", None)  # the sliding layers' pool (window_blocks.py)
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_cached=bm.num_cached_blocks,
            num_window_blocks_total=local.num_blocks if local else 0,
            num_window_blocks_used=local.num_used_blocks if local else 0,
            num_window_blocks_cached=local.num_cached_blocks if local else 0,
            prefix_cache_query_tokens=sched.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=sched.prefix_cache_hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
            num_draft_tokens=self.speculator.num_draft_tokens if self.speculator else 0,
            num_accepted_tokens=self.speculator.num_accepted_tokens if self.speculator else 0,
            **self.kv.stats(),
            adapters=[a.name for a in self.adapters.infos()],
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


class _Step:
    """A queued step: the requests that sample in it, in row order, their draws on
    the way to the host, and outputs it already has (requests that failed alone)."""

    def __init__(self, sampling: list[Request], pending: PendingSamples,
                 early_outputs: list[RequestOutput]) -> None:
        self.sampling = sampling
        self.pending = pending
        self.early_outputs = early_outputs
        self.finished = False

    def tokens(self) -> tuple[torch.Tensor, dict[int, int]]:
        """Its tokens on the device, and by id(request) where each request's is."""
        return self.pending.tokens, {id(r): i for i, r in enumerate(self.sampling)}


# A lease longer than this is refused: blocks held that long are a leak in all but name.
MAX_KV_LEASE_S = 600.0


def _check_continuation(prompt: list[int], output_token_ids: Sequence[int],
                        params: SamplingParams, vocab_size: int, max_model_len: int,
                        kv_lease_s: float) -> None:
    """The disaggregation fields of a request (InvalidRequestError naming the field)."""
    check_token_ids(output_token_ids, vocab_size, "output_token_ids")
    limit = params.max_tokens if params.max_tokens is not None else max_model_len
    if output_token_ids and (len(output_token_ids) >= limit
                             or len(prompt) + len(output_token_ids) >= max_model_len):
        raise InvalidRequestError(
            f"the request is complete already: {len(output_token_ids)} output token(s) "
            f"given, max_tokens {params.max_tokens}, context {max_model_len}",
            "output_token_ids")
    if not 0.0 <= kv_lease_s <= MAX_KV_LEASE_S:  # NaN fails too
        raise InvalidRequestError(f"kv_lease_s must be in [0, {MAX_KV_LEASE_S:g}], got "
                                  f"{kv_lease_s}", "kv_lease_s")
