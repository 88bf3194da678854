"""The decoder stack most families share: token embeddings, decoder layers, a final
RMSNorm and the lm_head, over a flat batch of tokens (N, C) in which every sequence of
the step is concatenated, so that each projection is one matmul for the whole step.

The residual stream is carried beside the hidden states, so that each residual add
fuses into the next RMSNorm (ops.add_rms_norm). A layer is pre-norm (Llama: h = x +
attn(norm(x)); out = h + mlp(norm(h))), with Gemma's norms of the attention's and the
MLP's outputs too where the config says (``sandwich_norms``); a family whose layers
differ passes its own layer class (OLMo-2's norm after each part)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from engine_worker.attention import AttentionMetadata
from engine_worker.models.layers.attention import Attention
from engine_worker.models.layers.embedding import embedding
from engine_worker.models.layers.linear import Role
from engine_worker.models.layers.mlp import MLP
from engine_worker.models.layers.moe import MoE
from engine_worker.models.layers.norm import RMSNorm
from engine_worker.models.layers.rotary import Rotary, reorder_partial_rotary
from engine_worker.ops import soft_cap

if TYPE_CHECKING:
    from engine_worker.models.config import ModelConfig
    from engine_worker.models.layers import Backends


def rope_kind(cfg: ModelConfig, index: int) -> int:
    """Layer ``index``'s RoPE: 1 the model's, 2 the local one (Gemma 3's sliding
    layers), 0 none (SmolLM3's NoPE layers)."""
    window = cfg.windows[index] if cfg.windows else 0
    return (0 if index in cfg.nope_layers
            else 2 if window and cfg.rope_local is not None else 1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backends: Backends, index: int) -> None:
        super().__init__()
        self.rope_kind = rope_kind(cfg, index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg, backends, cfg.windows[index] if cfg.windows else 0)
        # the norm before the MLP (Gemma's pre_feedforward_layernorm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp: nn.Module = (MoE(cfg, backends) if index in cfg.moe_layers
                               else MLP(cfg, backends))
        # Gemma's norms of the attention's and the MLP's outputs
        sandwich = cfg.sandwich_norms
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if sandwich else None
        self.ops = backends.ops

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None) ->
        (this layer's output, the residual stream before it)."""
        q, k, v, carry = self.before_attention(x, residual, rope, kv_cache, meta)
        return self.after_attention(self.self_attn.attend(q, k, v, kv_cache, meta), carry)

    # The layer in two parts around its attention (what a piecewise CUDA graph captures:
    # gpu/graphs.py); ``carry``: what the second takes of the first (here the residual).

    def before_attention(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                         rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        norm = self.input_layernorm
        h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return (*self.self_attn.prepare(h, rope, kv_cache, meta), residual)

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self._normed(self.self_attn.finish(out), self.attn_out_norm)
        norm = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self._normed(self.mlp(h), self.mlp_out_norm), residual

    def _normed(self, h: torch.Tensor, norm: Optional[RMSNorm]) -> torch.Tensor:
        return h if norm is None else self.ops.add_rms_norm(h, None, norm.weight, norm.eps)[0]


class DecoderModel(nn.Module):
    # Whether its steps may replay from CUDA graphs (gpu/graphs.py)
    cuda_graphs = True
    # its blocks, loaded and finished one at a time (models/loader.py)
    blocks = "layers"
    # Whether it may be split over tensor-parallel ranks (parallel.py): the shared
    # layers split themselves (a family whose layers compute otherwise says no)
    splits = True

    def __init__(self, cfg: ModelConfig, backends: Backends,
                 layer: Callable[[ModelConfig, "Backends", int], nn.Module] = DecoderLayer
                 ) -> None:
        super().__init__()
        assert cfg.rope is not None
        self.cfg = cfg
        self.ops = backends.ops
        # split over ranks: the vocabulary's rows (embeddings, lm_head), parallel.py
        self.parallel = p = backends.parallel
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, p)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.rotary_dim)
        # Gemma 3's sliding layers' own RoPE
        self.rotary_local = (None if cfg.rope_local is None
                             else Rotary(cfg.rope_local, cfg.head_dim, cfg.rotary_dim))
        self.layers = nn.ModuleList(layer(cfg, backends, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = backends.linear(cfg.hidden_size, cfg.vocab_size, role=Role.LM_HEAD,
                                       shard=p.column(p.vocab(cfg.vocab_size)))
        if cfg.tie_word_embeddings:   # the loader ties it to the embeddings
            self.lm_head.weight = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (N,) -> final hidden states (N, C)."""
        x, ropes = self.embed(input_ids, positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, ropes[layer.rope_kind], kv_cache, meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The embeddings, and the RoPE of each kind (rope_kind) at ``positions``."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        ropes = [
            # SmolLM3's layers without RoPE turn by angle 0
            (torch.ones_like(rope[0]), torch.zeros_like(rope[1])) if self.cfg.nope_layers
            else rope, rope,
            rope if self.rotary_local is None else self.rotary_local(positions, x.dtype)]
        return x, ropes

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    @property
    def embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, C) -> (S, V) (Gemma 2's soft-capped)."""
        logits = self.parallel.gather_vocab(self.lm_head(hidden), self.cfg.vocab_size)
        return soft_cap(logits, self.cfg.logit_softcap)

    @torch.no_grad()
    def finish_layer(self, layer: nn.Module) -> None:
        """A layer's weights, as a checkpoint holds them, made what the kernels compute
        with: Gemma's norms' 1 + weight; Granite's residual multiplier folded into o
        and down, whose outputs join the residual stream; where RoPE turns only a
        head's first dimensions, q's and k's reordered (rotary.py)."""
        cfg = self.cfg
        if cfg.norm_offset:
            for module in layer.modules():
                if isinstance(module, RMSNorm):
                    module.weight += 1.0
        if cfg.residual_multiplier != 1.0:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.scale_outputs(cfg.residual_multiplier)
        if cfg.rotary_dim is not None:
            reorder_partial_rotary(layer.self_attn, cfg)

    @torch.no_grad()
    def finish_checkpoint(self) -> None:
        """Once a checkpoint's weights are in: Gemma's final norm's 1 + weight, and the
        scales folded."""
        if self.cfg.norm_offset:
            self.norm.weight += 1.0
        self.fold_scales(tied=self.cfg.tie_word_embeddings)

    @torch.no_grad()
    def fold_scales(self, tied: bool) -> None:
        """Granite's constants and Gemma's scales of the embeddings folded into the
        weights they multiply: the embeddings; the final norm, whose output only makes
        the logits (so that an lm_head ``tied`` to the embeddings can compute with the
        scaled ones). (The residual multiplier is each layer's: finish_layer.) The
        scores' scale is the attention kernels' own (ModelConfig.attention_scale), as
        transformers applies it: a GGUF file's q rows are packed as the file holds
        them."""
        cfg = self.cfg
        multiplier = cfg.embedding_multiplier
        if cfg.norm_offset:   # Gemma's: rounded to the weights' dtype, as transformers has it
            multiplier = float(torch.tensor(multiplier, dtype=self.embed_tokens.weight.dtype))
        if multiplier != 1.0:
            self.embed_tokens.weight *= multiplier
        scale = cfg.logits_scaling * (multiplier if tied else 1.0)
        if scale != 1.0:
            self.norm.weight /= scale
