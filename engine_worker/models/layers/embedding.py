"""The token embedding table (room for a vocabulary split across ranks, later)."""

from __future__ import annotations

import torch
from torch import nn


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An embedding table without nn.Embedding's random init: on the meta device that
    goes through torch's Python reference ops, whose first use imports torch._dynamo,
    1.1 s of every engine start."""
    return nn.Embedding.from_pretrained(torch.empty(num_embeddings, dim))
