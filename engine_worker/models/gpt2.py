"""GPT-2: learned position embeddings, pre-LayerNorm blocks, GELU MLP, tied lm_head.

Hugging Face stores GPT-2's projections as Conv1D (weight (in, out)); they are
transposed once at load into ordinary linear layers. Runs on a flat batch (N, C).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.attention import AttentionBackend, AttentionMetadata
from engine_worker.models.config import ModelConfig
from engine_worker.models.layers import embedding, linear
from engine_worker.models.checkpoint import Checkpoint


def _layer_norm(size: int, eps: float) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=eps)
    norm.requires_grad_(False)
    return norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: AttentionBackend) -> None:
        super().__init__()
        c = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.gelu = "none" if cfg.hidden_act == "gelu" else "tanh"
        self.ln_1 = _layer_norm(c, cfg.norm_eps)
        self.c_attn = linear(c, 3 * c)
        self.attn_proj = linear(c, c)
        self.ln_2 = _layer_norm(c, cfg.norm_eps)
        self.c_fc = linear(c, cfg.intermediate_size)
        self.mlp_proj = linear(cfg.intermediate_size, c)
        self.attn = attn

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.c_attn(self.ln_1(x)).view(n, 3, self.num_heads, self.head_dim)
        attn = self.attn.forward(qkv[:, 0], qkv[:, 1], qkv[:, 2], kv_cache, meta)
        x = x + self.attn_proj(attn)
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate=self.gelu)
        return x + self.mlp_proj(h)


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = embedding(cfg.max_model_len, cfg.hidden_size)
        self.h = nn.ModuleList(Block(cfg, attn) for _ in range(cfg.num_layers))
        self.ln_f = _layer_norm(cfg.hidden_size, cfg.norm_eps)
        # Tied to wte; load_model may replace it with a packed copy.
        self.lm_head: Optional[nn.Module] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (N,) -> final hidden states (N, C)."""
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)

    def tied_lm_head_weight(self) -> torch.Tensor:
        return self.wte.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, C) -> (S, V), through the tied embedding."""
        if self.lm_head is None:
            return F.linear(hidden, self.wte.weight)
        return self.lm_head(hidden)

    def load_weights(self, ckpt: Checkpoint,
                     on_layer: Optional[Callable[[nn.Module], None]] = None) -> None:
        """on_layer: called with each block once its weights are in."""
        cfg = self.cfg
        c, inner = cfg.hidden_size, cfg.intermediate_size
        self.wte.weight.copy_(ckpt.take("wte.weight", (cfg.vocab_size, c)))
        self.wpe.weight.copy_(ckpt.take("wpe.weight", (cfg.max_model_len, c)))
        for i, block in enumerate(self.h):
            p = f"h.{i}."
            # Conv1D weights are (in, out): transpose into linear (out, in).
            pairs = [
                (block.c_attn, "attn.c_attn", (c, 3 * c)),
                (block.attn_proj, "attn.c_proj", (c, c)),
                (block.c_fc, "mlp.c_fc", (c, inner)),
                (block.mlp_proj, "mlp.c_proj", (inner, c)),
            ]
            for layer, name, shape in pairs:
                layer.weight.copy_(ckpt.take(p + name + ".weight", shape).t())
                layer.bias.copy_(ckpt.take(p + name + ".bias", (shape[1],)))
            for norm, name in ((block.ln_1, "ln_1"), (block.ln_2, "ln_2")):
                norm.weight.copy_(ckpt.take(p + name + ".weight", (c,)))
                norm.bias.copy_(ckpt.take(p + name + ".bias", (c,)))
            ckpt.discard(p + "attn.bias")  # causal-mask buffers in old checkpoints
            ckpt.discard(p + "attn.masked_bias")
            if on_layer is not None:
                on_layer(block)
        self.ln_f.weight.copy_(ckpt.take("ln_f.weight", (c,)))
        self.ln_f.bias.copy_(ckpt.take("ln_f.bias", (c,)))
        ckpt.discard("lm_head.weight")  # tied to wte
