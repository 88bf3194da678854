"""Runs one step's batch through the model: builds the step's inputs from the scheduled
requests, runs the forward pass, and computes logits only for rows that yield a token
(or whose prompt logprobs are wanted). The engine samples from them
(``runner.sampler``).

Paths, chosen once at start from the device and the model:
  * CPU, Llama family, C kernels: the whole step in one C call (llama.c, FusedLlama);
  * otherwise layer by layer through the model's torch modules, with an attention
    backend (attention.py: TorchAttention, CpuAttention, or TritonAttention on CUDA)
    and elementwise ops (ops.TorchOps, the C kernels, or gpu.ops.TritonOps), the step's
    inputs in persistent buffers (step_inputs.py);
  * on CUDA, decode-only steps of the Llama family, and steps of a few short prompt
    chunks alone, replay CUDA graphs (gpu/graphs.py) unless ``enforce_eager``; a
    step's input ids may come from the device (the engine's run-ahead: ``pending``).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from common.config import EngineConfig, SchedulerConfig
from engine_worker.attention import (AttentionBackend, CpuAttention, TorchAttention,
                                     kv_cache_shape)
from engine_worker.cpu.fused import FusedLlama
from engine_worker.cpu.kernels import cpu_kernels as load_cpu_kernels
from engine_worker.models.config import ModelConfig
from engine_worker.models.gguf import gguf_file
from engine_worker.models import PackedLinear, load_model
from engine_worker.ops import FP8, TorchOps
from engine_worker.sampler import Sampler
from engine_worker.scheduler import ScheduledRequest
from engine_worker.step_inputs import StepBatch, StepInputs, step_layout
from engine_worker.window_blocks import local_pool_blocks, split_pool

logger = logging.getLogger(__name__)

# --kv-cache-dtype: the cache's element type (None: the model's, _auto_kv_dtype).
_KV_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
              "fp8": FP8}
_DEFAULT_CPU_KV_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def _formats(config: EngineConfig, kernels, dtype: torch.dtype, device: torch.device,
             gguf_path: Optional[Path]) -> tuple[str, torch.dtype, Optional[torch.dtype]]:
    """The weights' format, the dtype the model computes in and the KV cache's (None:
    auto, decided once the weights are loaded), each checked against the others."""
    if gguf_path is not None and (config.quantization or dtype != torch.float32):
        raise ValueError(f"{gguf_path.name} is served as it is: --quantization and "
                         f"--dtype (other than auto or float32) do not apply to it")
    # On the CPU kernels, bfloat16 and int8 are formats of the packed weights;
    # activations stay float32 (the KV cache: ModelRunner._auto_kv_dtype).
    weight_format = str(dtype).removeprefix("torch.")
    if kernels is not None:
        weight_format = config.quantization or (
            "bfloat16" if dtype == torch.bfloat16 else "float32")
        dtype = torch.float32
    elif config.quantization is not None:
        raise ValueError(f"{config.quantization} weights need the CPU C kernels (--device "
                         f"cpu, a C compiler, not --no-cpu-kernels)")
    name = config.cache.kv_cache_dtype
    kv_dtype = _KV_DTYPES[name]
    if kv_dtype == FP8 and kernels is not None:
        raise ValueError("--kv-cache-dtype fp8 is for CUDA: the CPU kernels read a float32 "
                         "or bfloat16 cache (on the CPU only the torch reference path, "
                         "--attention-backend torch, reads fp8)")
    if kv_dtype not in (None, dtype, FP8) and device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype {name}: on {device.type} the KV cache is kept in "
                         f"the dtype the model computes in "
                         f"({str(dtype).removeprefix('torch.')}) or in fp8; use auto or fp8")
    return weight_format, dtype, kv_dtype


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_dir: Path, config: EngineConfig,
                 scheduler: SchedulerConfig, device: torch.device, dtype: torch.dtype) -> None:
        """scheduler: config.scheduler resolved for the device (its batch sizes and
        token budget size the step buffers)."""
        self.config = model_config
        self.device = device
        cache = config.cache
        self.block_size = cache.block_size
        kernels = None
        if (config.cpu_kernels and device.type == "cpu" and config.attention_backend == "auto"
                and dtype in (torch.float32, torch.bfloat16)):
            kernels = load_cpu_kernels()
        gguf_path = gguf_file(model_dir) if config.load_format != "dummy" else None
        self.weight_format, dtype, self.kv_dtype = _formats(config, kernels, dtype, device,
                                                            gguf_path)
        self.dtype = dtype
        max_seqs = max(scheduler.decode_batch_size, scheduler.prefill_batch_size)
        self.token_budget = scheduler.token_budget
        self.attn, ops = self._backend(config, kernels, max_seqs)
        # Multiprocessors the split decode attention fills (read once: not per step).
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)
        self.model = load_model(model_config, model_dir, device, dtype, self.attn, ops,
                                kernels, self.weight_format, config.load_format, config.seed)
        # A mixture's experts in one grouped GEMM a projection, routed on the device
        grouped = bool(model_config.moe_layers) and hasattr(self.attn, "tile_tokens")
        if grouped:
            from engine_worker.gpu.moe import group_experts

            group_experts(self.model)
        packed = Counter(m.fmt for m in self.model.modules() if isinstance(m, PackedLinear))
        if gguf_path is not None:  # the format most of its weights are packed in
            self.weight_format = packed.most_common(1)[0][0]
        if self.kv_dtype is None:
            self.kv_dtype = self._auto_kv_dtype(kernels, dtype)
        # the layers packed otherwise: a mixture's routers (float32), gpt-oss's experts
        # (mxfp4), a GGUF file's other types
        others = ", ".join(f"{n} in {fmt}" for fmt, n in sorted(packed.items())
                           if fmt != self.weight_format)
        shown = self.weight_format + (f" ({others} of {packed.total()} linear layers)"
                                      if others else "")
        products = kernels.products(self.weight_format) if kernels is not None else None
        if products is not None:
            logger.info("weights: %s, products: %s", shown, products)
        elif self.weight_format != "float32" or others:
            logger.info("weights: %s, computing in %s", shown, str(dtype).removeprefix("torch."))
        max_len = min(model_config.max_model_len, config.max_model_len or 1 << 62)
        # Sliding layers' blocks let go of as the window passes (window_blocks.py),
        # unless the config says not (CacheConfig.window_pool): mixed with full
        # layers, in a pool of their own (windowed); every layer sliding, in the one
        # pool (sliding).
        windows = model_config.windows or (0,)
        self.window = max(windows) if cache.window_pool else 0
        self.windowed = self.window > 0 and 0 in windows
        self.sliding = self.window > 0 and 0 not in windows
        self.inputs = StepInputs(scheduler.token_budget, max_seqs,
                                 -(-max_len // self.block_size), self.block_size, device,
                                 getattr(self.attn, "tile_tokens", 1), self.windowed)
        self._local_needed = (local_pool_blocks(self.window, self.block_size, max_seqs,
                                                scheduler.token_budget)
                              if self.windowed else 0)
        self.num_local_blocks = 0  # the sliding layers' pool's, its null block included
        self.sampler = Sampler(device, config.seed, kernels)
        self.kv_caches: list[torch.Tensor] = []
        self.fused: Optional[FusedLlama] = None
        self.graphs = None
        # Set by each forward: (request, first position, logits rows) of prompt
        # positions whose logprobs are wanted.
        self.prompt_logits: list[tuple] = []
        # And (request, logits rows) of the positions before its proposed tokens.
        self.draft_logits: list[tuple] = []
        # CUDA graphs for decode steps and prompt chunks (gpu/graphs.py).
        # (a mixture of experts routed on the host, not grouped, runs eagerly)
        graphs = (device.type == "cuda" and not config.enforce_eager
                  and model_config.family == "llama"
                  and (grouped or not model_config.moe_layers))
        if device.type == "cuda":
            self.num_blocks, self.num_local_blocks = self._size_gpu_cache(cache, scheduler,
                                                                          graphs)
        elif cache.num_blocks:
            self.num_blocks, self.num_local_blocks = self._given(cache.num_blocks)
        else:
            self.num_blocks, self.num_local_blocks = self._blocks_in(
                cache.kv_cache_memory_bytes or _DEFAULT_CPU_KV_BYTES)
        self.kv_caches = self._allocate_cache(self.num_blocks + self.sliding,  # null block
                                              self.num_local_blocks)
        # The whole forward pass in one C call, for the Llama family on the CPU.
        if (isinstance(self.attn, CpuAttention) and model_config.family == "llama"
                and FusedLlama.supports(self.model)):
            self.fused = FusedLlama(kernels, self.model, self.kv_caches, cache.block_size)
        if hasattr(self.attn, "tile_tokens"):  # TritonAttention
            self._compile_kernels(scheduler)
        if graphs:
            from engine_worker.gpu.graphs import CudaGraphCapture

            self.graphs = self.make_graph_runner(scheduler.decode_batch_size, CudaGraphCapture())
            self.graphs.capture_all()
        local = ""
        if self.windowed:
            local = (f"; sliding layers (a window of {self.window}): "
                     f"{self.num_local_blocks - 1} blocks of their own")
        elif self.sliding:
            local = f"; every layer slides (a window of {self.window}): blocks let go of"
        logger.info("KV cache: %d blocks x %d tokens, %s (%.0f MiB)%s", self.num_blocks,
                    cache.block_size, str(self.kv_dtype).removeprefix("torch."),
                    sum(c.numel() * c.element_size() for c in self.kv_caches) / 2**20, local)

    def _auto_kv_dtype(self, kernels, dtype: torch.dtype) -> torch.dtype:
        """--kv-cache-dtype auto: the dtype the model computes in, but bfloat16 where
        the CPU kernels hold weights of less precision than float32 (bfloat16, int8,
        4-bit; a GGUF file by the format most of its layers take), as a bfloat16 model
        on vLLM and a quantized file on llama.cpp (f16) keep theirs: half the bytes for
        attention to read, twice the tokens in the same memory, for a perplexity change
        under the weights' own (docs/performance.md). float32 weights keep float32, so
        that the default model's greedy output stays Hugging Face's token for token."""
        if kernels is not None and self.weight_format != "float32":
            return torch.bfloat16
        return dtype

    def _backend(self, config: EngineConfig, kernels, max_seqs: int
                 ) -> tuple[AttentionBackend, object]:
        """The attention backend (TorchAttention, CpuAttention or TritonAttention) and
        the elementwise ops, chosen once."""
        cfg = self.config
        args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale)
        triton = config.attention_backend == "triton" or (
            config.attention_backend == "auto" and self.device.type == "cuda")
        if triton:
            if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("the triton attention backend needs a CUDA device (on a CPU "
                                 "it runs only through Triton's interpreter, "
                                 "TRITON_INTERPRET=1: for tests)")
            bs = self.block_size
            if self.kv_dtype == FP8 and bs & (bs - 1):
                raise ValueError(f"--kv-cache-dtype fp8 needs a --block-size that is a power "
                                 f"of two (its attention kernel reads values a block's row "
                                 f"at a time), got {bs}")
            from engine_worker.gpu.attention import TritonAttention
            from engine_worker.gpu.ops import TritonOps

            return (TritonAttention(*args, max_seqs, self.device, self.kv_dtype == FP8,
                                    softcap=cfg.attn_softcap), TritonOps())
        if kernels is None:
            return TorchAttention(*args, softcap=cfg.attn_softcap), TorchOps()
        if not kernels.supports_head_dim(cfg.head_dim):
            logger.info("head_dim %d: decode attention uses the torch path", cfg.head_dim)
            return TorchAttention(*args, softcap=cfg.attn_softcap), kernels
        return CpuAttention(*args, kernels, softcap=cfg.attn_softcap), kernels

    def _layer_block_bytes(self) -> int:
        """One layer's keys and values of one block."""
        cfg = self.config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _blocks_in(self, budget: int) -> tuple[int, int]:
        """(blocks, the sliding layers' own blocks or 0) a KV memory budget holds."""
        per_layer = self._layer_block_bytes()
        num_local_layers = sum(1 for w in self.config.windows if w) if self.windowed else 0
        num_blocks, num_local = split_pool(budget, per_layer,
                                           self.config.num_layers - num_local_layers,
                                           num_local_layers, self._local_needed)
        num_blocks -= self.sliding  # the null block
        if num_blocks < 1:
            raise ValueError(
                f"a KV memory budget of {budget} bytes holds no block of "
                f"{per_layer * self.config.num_layers} bytes")
        return num_blocks, num_local

    def _given(self, num_blocks: int) -> tuple[int, int]:
        """--num-blocks: the full layers' pool; the sliding layers' holds what its
        requests can use of their windows, at most as many."""
        if not self.windowed:
            return num_blocks, 0
        return num_blocks, min(self._local_needed, num_blocks) + 1

    def _allocate_cache(self, num_blocks: int, num_local: int = 0) -> list[torch.Tensor]:
        """Each layer's cache: the sliding layers' of ``num_local`` blocks where they
        have a pool of their own (else of ``num_blocks``)."""
        cfg = self.config

        def cache(blocks: int) -> torch.Tensor:
            # Zeroed, not empty: padded reads of unused slots are masked out, but
            # garbage there could be NaN, and 0 * NaN would leak through the softmax.
            shape = kv_cache_shape(blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        return [cache(num_local if num_local and cfg.windows[i] else num_blocks)
                for i in range(cfg.num_layers)]

    def _zero_null_block(self) -> None:
        """The null block after made-up steps wrote there (their requests have no
        local table, or own block 0 where every layer slides): released entries must
        read zeros."""
        for i, c in enumerate(self.kv_caches):
            if self.sliding or (self.windowed and self.config.windows[i]):
                c[:, 0].zero_()

    def _size_gpu_cache(self, cache, scheduler: SchedulerConfig, graphs: bool
                        ) -> tuple[int, int]:
        """Blocks for the KV cache on the GPU (and the sliding layers' own, _blocks_in):
        given, or what is left after profiling (gpu/memory.py); ``graphs``: room for
        the CUDA graphs' largest steps too."""
        if cache.num_blocks is not None:
            return self._given(cache.num_blocks)
        if cache.kv_cache_memory_bytes is not None:
            return self._blocks_in(cache.kv_cache_memory_bytes)
        from engine_worker.gpu.memory import MemoryProfile

        free, total = torch.cuda.mem_get_info(self.device)
        torch_held = torch.cuda.memory_reserved(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        seqs = min(scheduler.decode_batch_size, scheduler.token_budget)
        peak = self.profile_peak(scheduler.token_budget, seqs)
        graph_pool = 0
        if graphs:  # the graphs hold their largest steps' activations
            from engine_worker.gpu.graphs import prompt_graph_seqs, prompt_graph_sizes

            graph_pool = max(self.profile_peak(scheduler.decode_batch_size,
                                               scheduler.decode_batch_size),
                             self.profile_peak(prompt_graph_sizes(scheduler.token_budget)[-1],
                                               prompt_graph_seqs(self.inputs.max_seqs)))
        profile = MemoryProfile(total=total, used_by_others=total - free - torch_held,
                                weights=weights, activation_peak=peak, graph_pool=graph_pool)
        kv_bytes = profile.kv_cache_bytes(cache.gpu_memory_utilization)
        logger.info("GPU memory: %.1f GiB total, %.0f%% usable; %s; KV cache %.2f GiB",
                    total / 2**30, cache.gpu_memory_utilization * 100, profile.describe(),
                    kv_bytes / 2**30)
        return self._blocks_in(kv_bytes)

    @torch.inference_mode()
    def profile_peak(self, tokens: int, seqs: int) -> int:
        """Bytes a step adds at its peak over the weights: a forward pass over
        ``tokens`` prompt tokens in ``seqs`` sequences (the token budget in as many
        sequences as may run; a decode batch; a prompt graph's largest step), the
        logits of every sequence and the sampler on them. Runs on a cache of just
        enough blocks, freed after."""
        from engine_worker.profile_step import dummy_step

        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        scheduled, blocks = dummy_step(tokens, seqs, self.block_size, self.inputs.width)
        # (the made-up requests' local tables read the null block)
        self.kv_caches = self._allocate_cache(blocks, 1 if self.windowed else 0)
        logits = self.forward(scheduled)
        self.sampler.profile(logits)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        cache_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.kv_caches = []
        del logits
        torch.cuda.empty_cache()
        return max(0, peak - cache_bytes)

    def make_graph_runner(self, max_batch: int, capture):
        """A GraphRunner over this runner's model and buffers (capture: CUDA graphs,
        or an eager stand-in in tests), with prompt graphs up to the token budget."""
        from engine_worker.gpu.graphs import GraphRunner, prompt_graph_sizes

        def step(input_ids, positions, meta, logits_rows) -> torch.Tensor:
            with torch.inference_mode():
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
                if logits_rows is not None:
                    hidden = hidden.index_select(0, logits_rows)
                return self.model.compute_logits(hidden)
        return GraphRunner(step, self.inputs, min(max_batch, self.inputs.max_seqs),
                           self._splits, capture, prompt_graph_sizes(self.token_budget))

    def _compile_kernels(self, scheduler: SchedulerConfig) -> None:
        """Runs a step of one prompt chunk and a decode step at each split count a
        step can take, so that no Triton kernel compiles while serving (a compile
        takes a second or so; the step inputs' alignment keeps the variants to these)."""
        from engine_worker.profile_step import dummy_step

        capacity = self.num_blocks * self.block_size
        chunk = min(scheduler.token_budget, 64, capacity)
        steps = [dummy_step(chunk, 1, self.block_size, self.inputs.width)[0]]
        top = min(scheduler.decode_batch_size, self.inputs.max_seqs, self.num_blocks)
        by_splits = {self._splits(b): b for b in range(top, 0, -1)}
        steps += [dummy_step(b, b, self.block_size, self.inputs.width)[0]  # decode rows
                  for b in by_splits.values()]
        for scheduled in steps:
            self.forward(scheduled)
        self._zero_null_block()

    def _splits(self, num_decode: int) -> int:
        """Programs each decode row's context is split over (Triton attention only)."""
        if hasattr(self.attn, "tile_tokens"):  # TritonAttention
            from engine_worker.gpu.attention import num_splits

            return num_splits(num_decode, self.config.num_kv_heads, self.num_sms)
        return 1

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
        if self.fused is not None:
            return self._forward_fused(scheduled, fills, pending)
        order, first_rows = step_layout(scheduled)
        fills = [(first_rows[i] + offset, source) for i, offset, source in fills]
        tokens = pending[0] if pending is not None else None
        sampled = [first_rows[i] + s.num_tokens - 1 for i, s in enumerate(scheduled)
                   if s.samples]
        extra = self._extra_rows(scheduled, first_rows)
        layout = [scheduled[i] for i in order]
        bucket = prompt_bucket = None
        if self.graphs is not None and not extra:
            if len(sampled) == len(layout) and all(s.num_tokens == 1 for s in layout):
                bucket = self.graphs.bucket(len(layout))
            elif all(s.num_tokens > 1 for s in layout):
                prompt_bucket = self.graphs.prompt_bucket(
                    sum(s.num_tokens for s in layout), len(layout))
        if bucket is not None:
            # Every row of a decode step samples, in layout order = schedule order.
            batch = self.inputs.prepare(layout, sampled, len(sampled), pad_to=bucket,
                                        num_splits=self.graphs.splits(bucket), fills=fills)
            batch.fill_ids(tokens)
            return self.graphs.run(batch)
        if prompt_bucket is not None:
            batch = self.inputs.prepare(layout, sampled, len(sampled), fills=fills,
                                        pad_chunks=(prompt_bucket, self.graphs.prompt_seqs))
            batch.fill_ids(tokens)
            logits = self.graphs.run_prompt(batch, prompt_bucket)
            return logits if sampled else None
        batch = self.inputs.prepare(layout, sampled + extra, len(sampled),
                                    num_splits=self._splits(sum(
                                        1 for s in layout if s.num_tokens == 1)), fills=fills)
        batch.fill_ids(tokens)
        return self._run_eager(batch)

    @staticmethod
    def _fills(scheduled: list[ScheduledRequest],
               pending: Optional[tuple[torch.Tensor, dict[int, int]]]
               ) -> list[tuple[int, int, int]]:
        """(index in scheduled, offset in its tokens this step, index in the pending
        tokens) of every placeholder the step computes."""
        fills = []
        for i, s in enumerate(scheduled):
            r = s.request
            if r.num_pending and r.num_computed_tokens + s.num_tokens == r.num_tokens:
                assert pending is not None and id(r) in pending[1], "a placeholder with no token"
                fills.append((i, s.num_tokens - 1, pending[1][id(r)]))
        return fills

    def _run_eager(self, batch: StepBatch) -> Optional[torch.Tensor]:
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.logits_rows.numel():
            return None
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_rows))
        return self._split_extra_logits(logits, batch.num_sampled)

    def _extra_rows(self, scheduled: list[ScheduledRequest], first_rows: list[int]
                    ) -> list[int]:
        """The rows of this step whose logits are wanted besides the samples: prompt
        positions whose logprobs requests want (prompt_logprobs), noted in
        ``prompt_logits``, then those before each proposed token (speculation), noted
        in ``draft_logits``; filled by _split_extra_logits."""
        rows: list[int] = []
        for s, first_row in zip(scheduled, first_rows):
            r = s.request
            if not r.needs_prompt_logits:
                continue
            start = r.num_computed_tokens
            # Position p's logits give the logprob of prompt token p + 1.
            lo = max(start, len(r.prompt_logprobs))
            hi = min(start + s.num_tokens, r.num_prompt_tokens - 1)
            if lo < hi:
                self.prompt_logits.append((r, lo, hi - lo))
                rows.extend(range(first_row + lo - start, first_row + hi - start))
        for s, first_row in zip(scheduled, first_rows):
            r = s.request
            if r.num_draft and s.samples:
                last = first_row + s.num_tokens - 1  # the sample's row, after them all
                self.draft_logits.append((r, r.num_draft))
                rows.extend(range(last - r.num_draft, last))
        return rows

    def _split_extra_logits(self, logits: torch.Tensor, num_samples: int
                            ) -> Optional[torch.Tensor]:
        at = num_samples
        for i, (request, first, count) in enumerate(self.prompt_logits):
            self.prompt_logits[i] = (request, first, logits[at:at + count])
            at += count
        for i, (request, count) in enumerate(self.draft_logits):
            self.draft_logits[i] = (request, logits[at:at + count])
            at += count
        return logits[:num_samples] if num_samples else None

    def _forward_fused(self, scheduled: list[ScheduledRequest],
                       fills: list[tuple[int, int, int]],
                       pending: Optional[tuple[torch.Tensor, dict[int, int]]]
                       ) -> Optional[torch.Tensor]:
        """The step as flat per-token arrays, in ``scheduled`` order, through llama.c."""
        assert self.fused is not None
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seq: list[int] = []
        sample_rows: list[int] = []
        first_rows: list[int] = []
        # per pool (the full layers', then the sliding layers' where windowed): the
        # tokens' slots and the sequences' block tables
        pools = [([], []) for _ in range(1 + self.windowed)]
        for i, s in enumerate(scheduled):
            r = s.request
            first_rows.append(len(input_ids))
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
            input_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            # A request checking proposed tokens: each of its rows a sequence of its
            # own, so that it attends as a decode row does (the same sums, in the same
            # order: the tokens are the ones decoding one at a time gives).
            rows, first = (s.num_tokens if r.num_draft else 1), len(pools[0][1])
            seq.extend(range(first, first + s.num_tokens) if r.num_draft
                       else [first] * s.num_tokens)
            for (slots, tables), table in zip(pools, (r.blocks, r.blocks.window)):
                block_ids = table.block_ids
                slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
                tables.extend([block_ids[:-(-end // bs)]] * rows)
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        extra = self._extra_rows(scheduled, first_rows)
        width = max(len(t) for t in pools[0][1])
        n, num_seqs = len(input_ids), len(pools[0][1])
        # Every int64 array of the step in one tensor (one host copy), viewed in parts.
        flat = torch.tensor(input_ids + positions + [p + 1 for p in positions] + seq
                            + [x for slots, tables in pools for x in slots
                               + [b for t in tables for b in t + [0] * (width - len(t))]]
                            + sample_rows + extra, dtype=torch.int64)
        ids, positions_t, ctx_lens, seq_t = flat[:4 * n].view(4, n)
        for i, offset, source in fills:  # placeholders: the ids the last step sampled
            ids[first_rows[i] + offset] = pending[0][source]
        at, views = 4 * n, []
        for _ in pools:
            views.append((flat[at:at + n], flat[at + n:at + n + num_seqs * width]
                          .view(num_seqs, width)))
            at += n + num_seqs * width
        cos, sin = self.model.rotary(positions_t, torch.float32)
        local = (None if self.model.rotary_local is None
                 else self.model.rotary_local(positions_t, torch.float32))
        logits = self.fused.forward(
            ids, cos, sin, views[0][0], seq_t, ctx_lens, views[0][1], flat[at:],
            max(positions) + 1, torch.get_num_threads(), local,
            views[1] if self.windowed else None)
        return self._split_extra_logits(logits, len(sample_rows))
