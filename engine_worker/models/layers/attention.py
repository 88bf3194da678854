"""A decoder layer's self-attention: q, k and v in one projection, RoPE and the KV
cache write in one op (the platform's ``rope_write_kv``), the platform's attention
backend over the paged cache (engine_worker/attention.py), the output projection.

Options, from the config: q/k/v and output biases (Qwen2, gpt-oss); each head of q and
k RMS-normed before RoPE (``qk_norm``: Qwen3, Gemma 3); a sliding window (the layer's
entry of ``windows``); a learned sink logit per head (gpt-oss). A family whose
attention differs overrides ``project`` (OLMo-2 norms q and k whole)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from engine_worker.attention import AttentionMetadata
from engine_worker.models.layers.norm import RMSNorm
from engine_worker.ops import calibrate_kv_scale

if TYPE_CHECKING:
    from engine_worker.models.config import ModelConfig
    from engine_worker.models.layers import Backends


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backends: Backends, window: int = 0) -> None:
        super().__init__()
        self.window = window  # > 0: a sliding window of that many keys
        # (split over ranks: this rank's heads, models/layers/parallel.py)
        self.parallel = p = backends.parallel
        q_heads, kv_heads = p.heads(cfg.num_heads, cfg.num_kv_heads)
        self.num_heads = q_heads.stop - q_heads.start
        self.num_kv_heads = kv_heads.stop - kv_heads.start
        d = self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        q_rows, kv_rows = slice(q_heads.start * d, q_heads.stop * d), \
            slice(kv_heads.start * d, kv_heads.stop * d)
        self.qkv_proj = backends.linear(cfg.hidden_size, (q_size, kv_size, kv_size),
                                        cfg.qkv_bias, shard=p.column(q_rows, kv_rows, kv_rows))
        self.o_proj = backends.linear(q_size, cfg.hidden_size, cfg.o_bias,
                                      shard=p.row(q_rows))
        # each head of q and k RMS-normed before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # gpt-oss: each head's sink logit
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
                      if cfg.attn_sinks else None)
        # (the loader's: the whole tensor's shape, this rank's part of it)
        self.shards = {"sinks": ((cfg.num_heads,), q_heads)}
        self.attn = backends.attn
        self.ops = backends.ops
        # An fp8 cache's scales (engine_worker/kv_scales.py): (key's, value's), float32
        # on the device; None for a cache of another dtype. A checkpoint's own, where
        # it has them, wait in checkpoint_kv_scale; ``kv_calibrating``: this step's keys
        # and values set them.
        self.kv_scale: Optional[torch.Tensor] = None
        self.checkpoint_kv_scale: Optional[torch.Tensor] = None
        self.kv_calibrating = False

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.prepare(x, rope, kv_cache, meta)
        return self.finish(self.attend(q, k, v, kv_cache, meta))

    # A forward's three parts: the projection, RoPE and the KV write; the attention
    # itself; the output projection (a piecewise CUDA graph captures the first and the
    # last and runs the attention eagerly: gpu/graphs.py).

    def prepare(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, C) -> q (N, Hq, D), k and v (N, Hkv, D), k and v written to the cache."""
        if self.window and meta.local is not None:
            meta = meta.local  # its blocks in the sliding layers' pool
        scale = self.kv_scale
        q, k, v = self.ops.rope_write_kv(self.project(x), *rope, self.num_heads,
                                         self.num_kv_heads, self.head_dim, kv_cache,
                                         meta.slot_mapping, self.head_norms(), scale)
        if scale is None:
            return q, k, v
        if self.kv_calibrating:
            calibrate_kv_scale(scale, k, v, kv_cache, meta.slot_mapping,
                               self.parallel.all_max if self.parallel.joined else None)
        # The cache holds k / k_scale and v / v_scale: q k = (q k_scale) (k / k_scale),
        # and the output, a mean of values, is v_scale times the cached values'.
        return q * scale[0], k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """-> (N, Hq D)."""
        if self.window and meta.local is not None:
            meta = meta.local
        return self.attn.attend(q, k, v, kv_cache, meta, self.window, self.sinks)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """(N, Hq D) -> (N, C) (split over ranks: summed over them)."""
        if self.kv_scale is not None:
            out = out * self.kv_scale[1]
        return self.parallel.all_reduce(self.o_proj(out))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> q, k and v side by side, (N, (Hq + 2 Hkv) D)."""
        return self.qkv_proj(x)

    def head_norms(self) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
        """The per-head norms of q and k for rope_write_kv, or None."""
        if self.q_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
