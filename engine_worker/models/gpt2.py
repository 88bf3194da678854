"""GPT-2: learned position embeddings, pre-LayerNorm blocks, a GELU MLP, the lm_head
tied to the embeddings. Runs on a flat batch (N, C).

Hugging Face stores GPT-2's projections as Conv1D, weights (in, out): the loader
transposes them into linear layers (Architecture.transposed)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ModelLoadError
from engine_worker.attention import AttentionMetadata
from engine_worker.models.config import ConfigSource, ModelConfig
from engine_worker.models.layers import Backends
from engine_worker.models.layers.embedding import embedding
from engine_worker.models.layers.linear import Role
from engine_worker.models.layers.norm import layer_norm
from engine_worker.models.spec import Architecture


def read_gpt2(source: ConfigSource) -> ModelConfig:
    raw = source.raw
    hidden = raw["n_embd"]
    num_heads = raw["n_head"]
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"unsupported GPT-2 activation_function {act!r}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if raw.get(flag):
            raise ModelLoadError(f"GPT-2 option {flag}=true is not supported")
    if not raw.get("scale_attn_weights", True):
        raise ModelLoadError("GPT-2 option scale_attn_weights=false is not supported")
    return ModelConfig(
        name=source.name,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["n_layer"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        max_model_len=raw["n_positions"],
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        hidden_act=act,
        eos_token_ids=source.eos_token_ids,
        rope=None,
        learned_positions=True,
        checkpoint_prefixes=("transformer.",),
    )


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, backends: Backends) -> None:
        super().__init__()
        c = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.gelu = "none" if cfg.hidden_act == "gelu" else "tanh"
        self.ln_1 = layer_norm(c, cfg.norm_eps)
        self.c_attn = backends.linear(c, (c, c, c), bias=True)
        self.attn_proj = backends.linear(c, c, bias=True)
        self.ln_2 = layer_norm(c, cfg.norm_eps)
        self.c_fc = backends.linear(c, cfg.intermediate_size, bias=True)
        self.mlp_proj = backends.linear(cfg.intermediate_size, c, bias=True)
        self.attn = backends.attn

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.c_attn(self.ln_1(x)).view(n, 3, self.num_heads, self.head_dim)
        attn = self.attn.forward(qkv[:, 0], qkv[:, 1], qkv[:, 2], kv_cache, meta)
        x = x + self.attn_proj(attn)
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate=self.gelu)
        return x + self.mlp_proj(h)


class GPT2Model(nn.Module):
    # its attention writes and reads the cache through the backend's forward, not
    # captured into CUDA graphs
    cuda_graphs = False
    blocks = "h"

    def __init__(self, cfg: ModelConfig, backends: Backends) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = embedding(cfg.max_model_len, cfg.hidden_size)
        self.h = nn.ModuleList(Block(cfg, backends) for _ in range(cfg.num_layers))
        self.ln_f = layer_norm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = backends.linear(cfg.hidden_size, cfg.vocab_size, role=Role.LM_HEAD)
        self.lm_head.weight = None   # tied to wte (models/loader.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (N,) -> final hidden states (N, C)."""
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)

    @property
    def embeddings(self) -> nn.Embedding:
        return self.wte

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, C) -> (S, V), through the tied embedding."""
        return self.lm_head(hidden)

    def finish_layer(self, block: nn.Module) -> None:
        """(Its checkpoints' weights are what it computes with.)"""

    def finish_checkpoint(self) -> None:
        """(Nothing to fold.)"""


# Its blocks' projections as its checkpoints name them (Conv1D, stored (in, out))
_PROJECTIONS: dict[str, Any] = {"h.*.c_attn": "h.*.attn.c_attn", "h.*.attn_proj": "h.*.attn.c_proj",
                                "h.*.c_fc": "h.*.mlp.c_fc", "h.*.mlp_proj": "h.*.mlp.c_proj"}

ARCHITECTURES = (
    Architecture("GPT2LMHeadModel", read_gpt2, GPT2Model, "GPT-2", names=_PROJECTIONS,
                 transposed=tuple(_PROJECTIONS),
                 # its causal masks, stored as buffers by old checkpoints
                 unused=(".attn.bias", ".attn.masked_bias")),
)
