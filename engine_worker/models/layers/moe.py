"""A mixture of experts: a router picks each token's experts, each a gated MLP
(mlp.py), and their outputs are summed, weighted."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from engine_worker.models.layers.linear import Role
from engine_worker.models.layers.mlp import MLP, gate_of

if TYPE_CHECKING:
    from engine_worker.models.config import ModelConfig
    from engine_worker.models.layers import Backends


class MoE(nn.Module):
    """A mixture of experts (Mixtral, Qwen3-MoE): the router's softmax over the experts
    picks each token's top k, whose SwiGLU MLPs run on it and are summed, weighted by
    their probabilities (renormalized over the k, where the model says; gpt-oss's: a
    softmax over the k chosen logits, as its router has it, the same up to rounding).
    Layer by layer (the torch ops), each expert runs once a step on the rows routed to
    it; the CPU's fused forward does the same in C (csrc/llama.c, ``mixture``); on the
    GPU they run grouped (engine_worker/gpu/moe.py: ``grouped``, which replaces
    ``experts``), routed on the device."""

    def __init__(self, cfg: ModelConfig, backends: Backends) -> None:
        super().__init__()
        self.gate = backends.linear(cfg.hidden_size, cfg.num_experts, cfg.expert_bias,
                                    Role.ROUTER)
        self.experts: Optional[nn.ModuleList] = None
        self.grouped: Optional[nn.Module] = None
        mxfp4 = cfg.expert_format == "mxfp4"
        if mxfp4 and backends.mxfp4_experts is not None:
            # gpt-oss's checkpoints' MXFP4 experts, kept so (the GPU's: 4.25 bits a weight)
            self.grouped = backends.mxfp4_experts(
                cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size,
                gate_of(cfg, backends.ops, expert=True), cfg.expert_bias)
        else:
            role = Role.MXFP4 if mxfp4 else Role.WEIGHT
            self.experts = nn.ModuleList(
                MLP(cfg, backends, cfg.expert_intermediate_size, expert=True, role=role,
                    reduce=False) for _ in range(cfg.num_experts))
        self.top_k, self.norm_topk = cfg.experts_per_token, cfg.norm_topk
        self.softmax_chosen = cfg.expert_bias
        # Qwen2-MoE's shared expert, gated by a sigmoid of its own
        self.shared_expert = (MLP(cfg, backends, cfg.shared_expert_size, reduce=False)
                              if cfg.shared_expert_size else None)
        # split over ranks: each expert's a run of its features; summed once, at the end
        self.parallel = backends.parallel
        self.shared_expert_gate = (backends.linear(cfg.hidden_size, 1, False, Role.ROUTER)
                                   if cfg.shared_expert_size else None)

    @torch.no_grad()
    def group(self, grouped: Callable[[nn.ModuleList], nn.Module]) -> None:
        """The experts replaced by ``grouped``'s one module of them all (the GPU's
        grouped GEMM, gpu/moe.py), their per-expert copies freed."""
        if self.experts is not None:
            self.grouped = grouped(self.experts)
            self.experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()
        if self.softmax_chosen:
            weights, chosen = torch.topk(logits, self.top_k, dim=-1)   # (N, k)
            weights = torch.softmax(weights, dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.grouped is not None:
            out = self.grouped(x, weights, chosen)
        else:
            out = self._each_expert(x, weights, chosen)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)

    def _each_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                     ) -> torch.Tensor:
        """Each chosen expert once, on its rows, in the experts' order and each one's
        rows in theirs, as transformers sums them. The choices are sorted once by expert
        (stably: (row, slot) pairs in row order) and each expert takes its run of them:
        a scan of every choice per expert took 1.25-1.56x the time a layer in Python
        (32 experts and 4 a token, or 128 and 8; 1 to 64 rows)."""
        k = chosen.shape[1]
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        rows_of, weight_of = order // k, weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(torch.bincount(flat).tolist()):
            if count:
                rows = rows_of[start:start + count]
                out.index_add_(0, rows, self.experts[expert](x[rows]) *
                               weight_of[start:start + count])
                start += count
        return out
