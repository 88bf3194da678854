"""OLMo 2 (AI2): a decoder whose norms follow the attention and the MLP instead of
preceding them (h = x + norm(attn(x)); out = h + norm(mlp(h))), and whose q and k are
RMS-normed over the whole projection, every head at once, before RoPE. Built of the
shared layers; the C kernels' one-call forward does not compute these norms, so on the
CPU it runs layer by layer (their packed GEMM and attention, all the same)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from common.errors import ModelLoadError
from engine_worker.attention import AttentionMetadata
from engine_worker.models.config import ConfigSource, ModelConfig, decoder_config
from engine_worker.models.layers import Backends
from engine_worker.models.layers.attention import Attention
from engine_worker.models.layers.decoder import DecoderModel, rope_kind
from engine_worker.models.layers.mlp import MLP
from engine_worker.models.layers.norm import RMSNorm
from engine_worker.models.spec import Architecture


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, backends: Backends, window: int = 0) -> None:
        super().__init__(cfg, backends, window)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.k_size = cfg.num_kv_heads * cfg.head_dim
        self.q_norm = RMSNorm(self.q_size, cfg.norm_eps)
        self.k_norm = RMSNorm(self.k_size, cfg.norm_eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (N, (Hq + 2 Hkv) D)
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.k_size]
        norm = self.ops.add_rms_norm
        return torch.cat([norm(q.contiguous(), None, self.q_norm.weight, self.q_norm.eps)[0],
                          norm(k.contiguous(), None, self.k_norm.weight, self.k_norm.eps)[0],
                          qkv[:, self.q_size + self.k_size:]], dim=1)

    def head_norms(self) -> None:
        return None   # (normed whole, in project)


class Olmo2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, backends: Backends, index: int) -> None:
        super().__init__()
        self.rope_kind = rope_kind(cfg, index)
        self.self_attn = Olmo2Attention(cfg, backends, cfg.windows[index] if cfg.windows else 0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg, backends)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ops = backends.ops

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None) ->
        (this layer's output, the residual stream before it)."""
        q, k, v, carry = self.before_attention(x, residual, rope, kv_cache, meta)
        return self.after_attention(self.self_attn.attend(q, k, v, kv_cache, meta), carry)

    def before_attention(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                         rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        """(DecoderLayer's two parts; the carry is the layer's input, whole)"""
        h = x if residual is None else x + residual
        return (*self.self_attn.prepare(h, rope, kv_cache, meta), h)

    def after_attention(self, out: torch.Tensor, h: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.post_attention_layernorm
        h = h + self.ops.add_rms_norm(self.self_attn.finish(out), None, norm.weight,
                                      norm.eps)[0]
        norm = self.post_feedforward_layernorm
        return self.ops.add_rms_norm(self.mlp(h), None, norm.weight, norm.eps)[0], h


class Olmo2Model(DecoderModel):
    # (its q and k norms span every head: not split over ranks yet)
    splits = False

    def __init__(self, cfg: ModelConfig, backends: Backends) -> None:
        super().__init__(cfg, backends, Olmo2Layer)


def read_olmo2(source: ConfigSource) -> ModelConfig:
    config = decoder_config(source)
    if config.rotary_dim is not None:
        raise ModelLoadError("OLMo 2 with a partial_rotary_factor is not served (its q and "
                             "k norms span the whole projection)")
    return config


ARCHITECTURES = (
    Architecture("Olmo2ForCausalLM", read_olmo2, Olmo2Model, "OLMo 2"),
)
