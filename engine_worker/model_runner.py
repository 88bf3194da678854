"""Runs one step's batch through the model: the placeholders the step computes and
the rows whose logits are wanted, handed to the forward the platform chose
(forward.py: layer by layer, from CUDA graphs, or in one C call), and the logits of
the rows that yield a token (or whose prompt logprobs are wanted) back. The engine
samples from them (``runner.sampler``).

Everything that depends on the device is the platform's (platform.py), asked once at
start: the weights' formats, the attention backend and ops, the KV cache's size, what
compiles first, and what runs a step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from common.config import EngineConfig, SchedulerConfig
from engine_worker.forward import EagerForward, Fill, Row
from engine_worker.kv_cache import KvCache
from engine_worker.kv_scales import KvScales
from engine_worker.models.loader import load_model
from engine_worker.models.config import ModelConfig
from engine_worker.models.gguf import gguf_file
from engine_worker.models.layers.linear import Linear, WeightFormats
from engine_worker.models.layers.lora import LoraContext
from engine_worker.models.layers.parallel import join
from engine_worker.ops import FP8
from engine_worker.platform import Platform
from engine_worker.sampler import Sampler
from engine_worker.scheduler import ScheduledRequest
from engine_worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_dir: Path, config: EngineConfig,
                 scheduler: SchedulerConfig, platform: Platform) -> None:
        """scheduler: config.scheduler resolved for the device (its batch sizes and
        token budget size the step buffers)."""
        self.config, self.device = model_config, platform.device
        cache = config.cache
        self.block_size = cache.block_size
        self.token_budget = scheduler.token_budget
        max_seqs = max(scheduler.decode_batch_size, scheduler.prefill_batch_size)
        gguf_path = gguf_file(model_dir) if config.load_format != "dummy" else None
        formats, self.dtype, kv_dtype = platform.formats(config, model_config, gguf_path)
        # split over tensor-parallel ranks: this rank's heads (attention, KV cache)
        self.parallel = join(config.tensor_parallel_size)
        self.parallel.agree(repr({k: v for k, v in dataclasses.asdict(config).items()
                                  if k not in ("device", "num_threads")}))
        local = self.parallel.local(model_config)
        self.attn, ops = platform.attention(local, kv_dtype, cache.block_size, max_seqs)
        backends = dataclasses.replace(platform.backends(self.attn, ops, formats),
                                       parallel=self.parallel)
        self.model = load_model(model_config, model_dir, backends, self.device, self.dtype,
                                gguf_path, config.load_format, config.seed)
        platform.prepare(self.model)
        self.weight_format = self._weight_format(formats, gguf_path is not None, platform)
        self.kv_dtype = kv_dtype or platform.auto_kv_dtype(self.weight_format, self.dtype)
        self.kv = KvCache(local, cache.block_size, self.kv_dtype, self.device,
                          cache.window_pool, max_seqs, scheduler.token_budget,
                          self.parallel.kv_share(model_config.num_heads,
                                                 model_config.num_kv_heads))
        self.kv_scales = KvScales(self.model, self.device) if self.kv_dtype == FP8 else None
        max_len = min(model_config.max_model_len, config.max_model_len or 1 << 62)
        self.inputs = StepInputs(scheduler.token_budget, max_seqs, -(-max_len // self.block_size),
                                 self.block_size, self.device, self.attn.tile_tokens,
                                 self.windowed, self.attn.chunk_tiles, self.parallel)
        self.sampler = Sampler(self.device, config.seed, platform.kernels)
        # Set by each forward: (request, first position, logits rows) of prompt
        # positions whose logprobs are wanted; and (request, logits rows) of the
        # positions before its proposed tokens.
        self.prompt_logits: list[tuple] = []
        self.draft_logits: list[tuple] = []
        self.eager = EagerForward(self.model, self.inputs, self.kv.layers,
                                  self.attn.decode_splits)
        blocks = platform.kv_blocks(self.kv, cache, scheduler, self.eager, self.sampler)
        self.kv.num_blocks, self.kv.num_local_blocks = self.parallel.least(blocks)
        self.kv.allocate(self.num_blocks + self.sliding, self.num_local_blocks)  # null block
        platform.warm_up(self.eager, self.kv, scheduler)
        # (split over ranks: every step eager, the one the other ranks follow)
        self.step = (platform.forward(self.eager, self.attn, self.kv, scheduler)
                     if self.parallel.size == 1 else self.eager)
        self.lora: Optional[LoraContext] = None   # (use_lora)
        # Requests of LoRA adapters or embeddings the engine holds (it counts them):
        # none, and forward does not look through a step's requests for them.
        self.num_special = 0
        if self.kv_scales is not None:
            self.kv_scales.calibrate_next()   # (from the first real prompts, not the above)
        self._log_cache()

    # The KV cache's shape, as the engine's block managers take it (kv_cache.py)
    kv_caches = property(lambda self: self.kv.layers)
    num_blocks = property(lambda self: self.kv.num_blocks)
    num_local_blocks = property(lambda self: self.kv.num_local_blocks)
    window = property(lambda self: self.kv.window)
    windowed = property(lambda self: self.kv.windowed)
    sliding = property(lambda self: self.kv.sliding)

    def _weight_format(self, formats: WeightFormats, gguf: bool, platform: Platform) -> str:
        """The format the weights are in (a GGUF file's: the one most of its layers
        are packed in), logged with the layers packed otherwise: a mixture's routers
        (float32), gpt-oss's experts (mxfp4), a GGUF file's other types."""
        counts = Counter(m.fmt for m in self.model.modules() if isinstance(m, Linear))
        fmt = counts.most_common(1)[0][0] if gguf else formats.method.name
        others = ", ".join(f"{n} in {f}" for f, n in sorted(counts.items()) if f != fmt)
        shown = fmt + (f" ({others} of {counts.total()} linear layers)" if others else "")
        products = platform.products(fmt)
        if products is not None:
            logger.info("weights: %s, products: %s", shown, products)
        elif fmt != "float32" or others:
            logger.info("weights: %s, computing in %s", shown,
                        str(self.dtype).removeprefix("torch."))
        return fmt

    def _log_cache(self) -> None:
        local = ""
        if self.windowed:
            local = (f"; sliding layers (a window of {self.window}): "
                     f"{self.num_local_blocks - 1} blocks of their own")
        elif self.sliding:
            local = f"; every layer slides (a window of {self.window}): blocks let go of"
        logger.info("KV cache: %d blocks x %d tokens, %s (%.0f MiB)%s", self.num_blocks,
                    self.block_size, str(self.kv_dtype).removeprefix("torch."),
                    self.kv.nbytes / 2**20, local)

    @torch.inference_mode()
    def follow(self) -> None:
        """A tensor-parallel rank other than 0: every step rank 0 prepares, run on this
        rank's shards (its logits are rank 0's to sample), until rank 0 stops."""
        while (batch := self.inputs.receive()) is not None:
            calibrating = self.kv_scales is not None and self.kv_scales.calibrating
            self.eager.logits(self.model(batch.input_ids, batch.positions, self.kv.layers,
                                         batch.meta), batch)
            if calibrating:   # (rank 0's first step set its fp8 scales; this one, these)
                self.kv_scales.calibrated()

    def use_lora(self, context: LoraContext) -> None:
        """Serve LoRA adapters (engine_worker/lora.py), whose rows ``context`` tells."""
        self.lora = self.eager.lora = context
        if self.step is not self.eager:
            self.step.lora = context

    @torch.inference_mode()
    def forward(self, scheduled: list[ScheduledRequest],
                pending: Optional[tuple[torch.Tensor, dict[int, int]]] = None
                ) -> Optional[torch.Tensor]:
        """Compute the scheduled tokens (writing their KV). Returns the logits (S, V) of
        the requests whose step reaches the end of their known tokens (``samples``),
        in ``scheduled`` order, or None when no request samples this step. The logits
        of prompt positions that requests want logprobs of are left in
        ``prompt_logits``: (request, first position, rows (P, V)) per request.

        ``scheduled`` is in the scheduler's order, where a request may attend to
        blocks that an earlier one fills in the same step; all KV writes of a layer
        precede its reads, which makes that safe.

        ``pending``: the previous step's sampled tokens (a device tensor) and, by
        ``id(request)``, where each request's token is in it: a request whose newest
        token is a placeholder (``num_pending``) reads its id from there."""
        self.prompt_logits, self.draft_logits = [], []
        fills = self._fills(scheduled, pending)
        extra = self._extra_rows(scheduled)
        calibrating = self.kv_scales is not None and self.kv_scales.calibrating
        special = self.num_special > 0
        adapters = special and self.lora is not None and any(s.request.lora_slot
                                                             for s in scheduled)
        pooling = special and any(s.request.embed for s in scheduled)
        # (the first step sets an fp8 cache's scales, eagerly; a step with embeddings'
        # rows runs eagerly too, as one with LoRA adapters' rows where the step cannot
        # apply them: forward.pool, models/layers/lora.py)
        eager = calibrating or pooling or (adapters and not self.step.serves_lora())
        step = self.eager if eager else self.step
        if self.lora is not None:
            self.lora.active = adapters
        self.eager.pooling = pooling
        try:
            logits = step(scheduled, fills, pending[0] if pending is not None else None, extra)
        finally:
            if self.lora is not None:
                self.lora.active = False
        if calibrating:
            self.kv_scales.calibrated()
        return self._split_extra_logits(logits, sum(1 for s in scheduled if s.samples))

    @staticmethod
    def _fills(scheduled: list[ScheduledRequest],
               pending: Optional[tuple[torch.Tensor, dict[int, int]]]) -> list[Fill]:
        """(index in scheduled, offset in its tokens this step, index in the pending
        tokens) of every placeholder the step computes."""
        fills = []
        for i, s in enumerate(scheduled):
            r = s.request
            if r.num_pending and r.num_computed_tokens + s.num_tokens == r.num_tokens:
                assert pending is not None and id(r) in pending[1], "a placeholder with no token"
                fills.append((i, s.num_tokens - 1, pending[1][id(r)]))
        return fills

    def _extra_rows(self, scheduled: list[ScheduledRequest]) -> list[Row]:
        """The rows of this step whose logits are wanted besides the samples, as
        (index in scheduled, offset in its tokens): prompt positions whose logprobs
        requests want (prompt_logprobs), noted in ``prompt_logits``, then those before
        each proposed token (speculation), noted in ``draft_logits``; filled by
        _split_extra_logits."""
        rows: list[Row] = []
        for i, s in enumerate(scheduled):
            r = s.request
            if not r.needs_prompt_logits:
                continue
            start = r.num_computed_tokens
            # Position p's logits give the logprob of prompt token p + 1.
            lo = max(start, len(r.prompt_logprobs))
            hi = min(start + s.num_tokens, r.num_prompt_tokens - 1)
            if lo < hi:
                self.prompt_logits.append((r, lo, hi - lo))
                rows.extend((i, p - start) for p in range(lo, hi))
        for i, s in enumerate(scheduled):
            r = s.request
            if r.num_draft and s.samples:
                # the rows before the sample's, after them all
                self.draft_logits.append((r, r.num_draft))
                last = s.num_tokens - 1
                rows.extend((i, offset) for offset in range(last - r.num_draft, last))
        return rows

    def _split_extra_logits(self, logits: Optional[torch.Tensor], num_samples: int
                            ) -> Optional[torch.Tensor]:
        if logits is None:
            return None
        at = num_samples
        for i, (request, first, count) in enumerate(self.prompt_logits):
            self.prompt_logits[i] = (request, first, logits[at:at + count])
            at += count
        for i, (request, count) in enumerate(self.draft_logits):
            self.draft_logits[i] = (request, logits[at:at + count])
            at += count
        return logits[:num_samples] if num_samples else None
