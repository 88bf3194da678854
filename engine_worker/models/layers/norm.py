"""Norms: RMSNorm (the platform's ops compute it, fused with the residual add:
engine_worker/ops.py) and LayerNorm (GPT-2's, torch's own)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """A scale per channel; ops.add_rms_norm computes it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps


def layer_norm(size: int, eps: float) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=eps)
    norm.requires_grad_(False)
    return norm

