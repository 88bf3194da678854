"""Attention on the CPU kernels: single-token queries through the C kernel, which
reads the paged cache in place; prompt chunks as the reference does
(engine_worker/attention.py: TorchAttention)."""

from __future__ import annotations

from typing import Optional

import torch

from engine_worker.attention import AttentionMetadata, TorchAttention
from engine_worker.cpu.kernels import CpuKernels


class CpuAttention(TorchAttention):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kernels: CpuKernels, softcap: float = 0.0) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, softcap)
        self.kernels = kernels

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                window: int = 0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.kernels.paged_decode_attention(
            q, kv_cache, meta.decode_tables_int64, meta.decode_lens_int64, self.scale,
            window, self.softcap, sinks)
