"""The token embedding table, whole or split over tensor-parallel ranks by its rows
(the vocabulary: models/layers/parallel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.models.layers.parallel import NOT_SPLIT, Parallel


def embedding(num_embeddings: int, dim: int, parallel: Parallel = NOT_SPLIT) -> nn.Embedding:
    """An embedding table without nn.Embedding's random init: on the meta device that
    goes through torch's Python reference ops, whose first use imports torch._dynamo,
    1.1 s of every engine start."""
    if parallel.size > 1:
        return VocabShard(num_embeddings, dim, parallel)
    return nn.Embedding.from_pretrained(torch.empty(num_embeddings, dim))


class VocabShard(nn.Embedding):
    """A rank's rows of the vocabulary: a token outside them embeds as zeros, and an
    all-reduce gives every rank every token's row."""

    def __init__(self, num_embeddings: int, dim: int, parallel: Parallel) -> None:
        rows = parallel.vocab(num_embeddings)
        size = rows.stop - rows.start
        super().__init__(size, dim, _weight=torch.empty(size, dim), _freeze=True)
        self.parallel, self.first = parallel, rows.start
        # (the loader's: the whole table's shape, this rank's rows of it)
        self.shards = {"weight": ((num_embeddings, dim), rows)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))
