"""Runs one step's batch through the model: builds the flat inputs and the attention
metadata from the scheduled requests, runs the forward pass, and computes logits only
for rows that yield a token. The engine samples from them (``runner.sampler``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from common.config import CacheConfig
from engine_worker.attention import (AttentionMetadata, ChunkMetadata, PagedAttention,
                                     kv_cache_shape)
from engine_worker.kernels import FusedLlama
from engine_worker.kernels import cpu_kernels as load_cpu_kernels
from engine_worker.model_config import ModelConfig
from engine_worker.models import load_model
from engine_worker.sampler import Sampler
from engine_worker.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 << 30
_CUDA_MEMORY_FRACTION = 0.9


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


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_dir: Path, cache: CacheConfig,
                 device: torch.device, dtype: torch.dtype, seed: int,
                 cpu_kernels: bool = True, quantization: Optional[str] = None) -> None:
        self.config = model_config
        self.device = device
        self.block_size = cache.block_size
        kernels = None
        if cpu_kernels and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            kernels = load_cpu_kernels()
        # On the CPU kernels, bfloat16 and int8 are formats of the packed weights;
        # activations and the KV cache stay float32.
        self.weight_format = str(dtype).removeprefix("torch.")
        if kernels is not None:
            self.weight_format = quantization or (
                "bfloat16" if dtype == torch.bfloat16 else "float32")
            dtype = torch.float32
        elif quantization is not None:
            raise ValueError(f"{quantization} weights need the CPU C kernels (--device cpu, "
                             f"a C compiler, not --no-cpu-kernels)")
        self.dtype = dtype
        attn_kernels = kernels
        if kernels is not None and not kernels.supports_head_dim(model_config.head_dim):
            logger.info("head_dim %d: decode attention uses the torch path",
                        model_config.head_dim)
            attn_kernels = None
        self.attn = PagedAttention(model_config.num_heads, model_config.num_kv_heads,
                                   model_config.head_dim, model_config.head_dim ** -0.5,
                                   attn_kernels)
        self.model = load_model(model_config, model_dir, device, dtype, self.attn, kernels,
                                self.weight_format)
        if self.weight_format != "float32":
            logger.info("weights: %s, computing in float32", self.weight_format)
        self.num_blocks = self._num_blocks(cache)
        shape = kv_cache_shape(self.num_blocks, cache.block_size,
                               model_config.num_kv_heads, model_config.head_dim)
        # Zeroed, not empty: padded reads of unused slots are masked out, but garbage
        # there could be NaN, and 0 * NaN would leak through the softmax.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(model_config.num_layers)]
        self.sampler = Sampler(device, seed, kernels)
        # The whole forward pass in one C call, for the Llama family on the CPU.
        self.fused: Optional[FusedLlama] = None
        # Set by each forward: (request, first position, logits rows) of prompt
        # positions whose logprobs are wanted.
        self.prompt_logits: list[tuple] = []
        if attn_kernels is not None and model_config.family == "llama":
            self.fused = FusedLlama(attn_kernels, self.model, self.kv_caches, cache.block_size)
        logger.info("KV cache: %d blocks x %d tokens (%.0f MiB)", self.num_blocks,
                    cache.block_size, self.num_blocks * self._bytes_per_block() / 2**20)

    def _bytes_per_block(self) -> int:
        cfg = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * _CUDA_MEMORY_FRACTION)
            else:
                budget = _DEFAULT_CPU_KV_BYTES
        num_blocks = budget // self._bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"a KV memory budget of {budget} bytes holds no block of "
                f"{self._bytes_per_block()} bytes")
        return num_blocks

    @torch.inference_mode()
    def forward(self, scheduled: list[ScheduledRequest]) -> Optional[torch.Tensor]:
        """Compute the scheduled tokens (writing their KV). Returns the logits (S, V) of
        the requests whose step reaches the end of their known tokens (``samples``),
        in ``scheduled`` order, or None when no request samples this step. The logits
        of prompt positions that requests want logprobs of are left in
        ``prompt_logits``: (request, first position, rows (P, V)) per request.

        ``scheduled`` is in the scheduler's order, where a request may attend to
        blocks that an earlier one fills in the same step; all KV writes of a layer
        precede its reads, which makes that safe."""
        self.prompt_logits = []
        if self.fused is not None:
            return self._forward_fused(scheduled)
        # Layer by layer, the batch laid out with single-token queries first
        # (attention.py).
        layout = sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_tokens > 1)
        input_ids, positions, meta, last_rows = self._prepare([scheduled[i] for i in layout])
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # (N, C)
        last_row = dict(zip(layout, last_rows))
        rows = [last_row[i] for i, s in enumerate(scheduled) if s.samples]
        extra = self._prompt_rows(scheduled, [last_row[i] - s.num_tokens + 1
                                              for i, s in enumerate(scheduled)])
        if not rows and not extra:
            return None
        index = torch.tensor(rows + extra, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return self._split_prompt_logits(logits, len(rows))

    def _prompt_rows(self, scheduled: list[ScheduledRequest], first_rows: list[int]
                     ) -> list[int]:
        """The rows of this step's prompt positions whose logits requests want
        (prompt_logprobs), noted in ``prompt_logits`` (filled by _split_prompt_logits)."""
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
        return rows

    def _split_prompt_logits(self, logits: torch.Tensor, num_samples: int
                             ) -> Optional[torch.Tensor]:
        at = num_samples
        for i, (request, first, count) in enumerate(self.prompt_logits):
            self.prompt_logits[i] = (request, first, logits[at:at + count])
            at += count
        return logits[:num_samples] if num_samples else None

    def _add_tokens(self, s: ScheduledRequest, input_ids: list[int], positions: list[int],
                    slots: list[int]) -> tuple[int, int]:
        """Appends the ids, positions and cache slots of the tokens ``s`` computes this
        step; returns their range of positions [start, end)."""
        r, bs = s.request, self.block_size
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
        block_ids = r.blocks.block_ids
        input_ids.extend(r.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
        return start, end

    def _forward_fused(self, scheduled: list[ScheduledRequest]) -> Optional[torch.Tensor]:
        """The step as flat per-token arrays, in ``scheduled`` order, through llama.c."""
        assert self.fused is not None
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        first_rows: list[int] = []
        for i, s in enumerate(scheduled):
            first_rows.append(len(input_ids))
            start, end = self._add_tokens(s, input_ids, positions, slots)
            seq.extend([i] * s.num_tokens)
            tables.append(s.request.blocks.block_ids[:-(-end // bs)])
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        extra = self._prompt_rows(scheduled, first_rows)
        width = max(len(t) for t in tables)
        positions_t = torch.tensor(positions)
        cos, sin = self.model.rotary(positions_t, torch.float32)
        logits = self.fused.forward(
            torch.tensor(input_ids), cos, sin, torch.tensor(slots), torch.tensor(seq),
            positions_t + 1, torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            torch.tensor(sample_rows + extra, dtype=torch.int64), max(positions) + 1,
            torch.get_num_threads())
        return self._split_prompt_logits(logits, len(sample_rows))

    def _prepare(self, scheduled: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The flat batch of ``scheduled`` (single-token queries first), its attention
        metadata, and the row of each request's last token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        single_tables: list[list[int]] = []
        single_lens: list[int] = []
        chunks: list[ChunkMetadata] = []
        last_rows: list[int] = []
        for s in scheduled:
            block_ids = s.request.blocks.block_ids
            query_start = len(input_ids)
            start, end = self._add_tokens(s, input_ids, positions, slots)
            num_blocks = -(-end // bs)
            if s.num_tokens == 1:
                single_tables.append(block_ids[:num_blocks])
                single_lens.append(end)
            else:
                mask = None
                if start > 0:  # attends to a cached prefix: causal with an offset
                    q_pos = torch.arange(start, end).unsqueeze(1)
                    mask = (torch.arange(end).unsqueeze(0) <= q_pos).to(self.device)
                chunks.append(ChunkMetadata(
                    query_start=query_start, query_len=s.num_tokens, context_len=end,
                    block_ids=torch.tensor(block_ids[:num_blocks], device=self.device),
                    mask=mask))
            last_rows.append(len(input_ids) - 1)

        single_block_tables = single_context_lens = single_mask = None
        if single_tables:
            width = max(len(t) for t in single_tables)
            padded = [t + [0] * (width - len(t)) for t in single_tables]
            single_block_tables = torch.tensor(padded, device=self.device)
            lens = torch.tensor(single_lens)
            single_context_lens = lens.to(self.device)
            if self.attn.needs_mask:
                mask = torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)
                single_mask = mask.view(len(single_tables), 1, 1, width * bs).to(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            num_single=len(single_tables),
            single_block_tables=single_block_tables,
            single_context_lens=single_context_lens,
            single_mask=single_mask,
            chunks=chunks,
        )
        return (torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device), meta, last_rows)
