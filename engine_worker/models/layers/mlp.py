"""A gated MLP: gate and up in one projection, the gate's activation times up, down."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from engine_worker.models.layers.linear import Role
from engine_worker.ops import Ops

if TYPE_CHECKING:
    from engine_worker.models.config import ModelConfig
    from engine_worker.models.layers import Backends


def gate_of(cfg: ModelConfig, ops: Ops, expert: bool = False
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """An MLP's gate: SiLU, Gemma's GELU (tanh form), or gpt-oss's experts' clamped
    SwiGLU."""
    if expert and cfg.swiglu_limit:
        return functools.partial(ops.clamped_swiglu, alpha=cfg.swiglu_alpha,
                                 limit=cfg.swiglu_limit)
    return ops.gelu_tanh_mul if cfg.hidden_act == "gelu_pytorch_tanh" else ops.silu_mul


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, backends: Backends,
                 intermediate: Optional[int] = None, expert: bool = False,
                 role: Role = Role.WEIGHT, reduce: bool = True) -> None:
        """expert: one of a mixture's experts (gpt-oss's have biases and a gate of
        their own); role: its linear layers' (linear.py). Split over ranks, each holds
        a run of the intermediate features, and its output is summed over them
        (``reduce``; a mixture's experts' are summed once, by the mixture)."""
        super().__init__()
        intermediate = intermediate or cfg.intermediate_size
        bias = cfg.mlp_bias or (expert and cfg.expert_bias)
        self.parallel = p = backends.parallel
        features = p.split(intermediate, "the MLP's intermediate features", unit=32)
        self.gate_up_proj = backends.linear(cfg.hidden_size, (intermediate, intermediate),
                                            bias, role, p.column(features, features))
        self.down_proj = backends.linear(intermediate, cfg.hidden_size, bias, role,
                                         p.row(features))
        self.act = gate_of(cfg, backends.ops, expert)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return self.parallel.all_reduce(out) if self.reduce else out
