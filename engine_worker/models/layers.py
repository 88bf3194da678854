"""The torch layers the models are built of, made without their random init: a model is
built on the meta device and its weights are copied in next (models/__init__.py)."""

from __future__ import annotations

import torch
from torch import nn


def linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.requires_grad_(False)
    return layer


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    # from a given tensor, not nn.Embedding's normal_ init: on the meta device that
    # goes through torch's Python reference ops, whose first use imports torch._dynamo,
    # 1.1 s of every engine start
    return nn.Embedding.from_pretrained(torch.empty(num_embeddings, dim))
