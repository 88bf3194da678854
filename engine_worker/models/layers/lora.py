"""LoRA adapters on the linear layers, many in one batch: each token row's adapter
adds its low-rank product (x A^T) B^T, scaled, to the layer's output, grouped by
adapter, never merged into the weights (S-LoRA's and Punica's way), so that requests
of different adapters and of none share every step.

A layer an adapter targets holds that adapter's A (r, in) and B (out, r) by slot
(``LoraWeights``); a fused layer's (q, k and v; gate and up) are its parts' stacked:
A's rows one part's after another, B block-diagonal. B carries the adapter's scaling
(alpha / r, or alpha / sqrt(r) for rsLoRA) and what the loader did to the layer's
outputs (a residual multiplier folded in, rows reordered for a partial RoPE), and a
layer split over tensor-parallel ranks holds its part (B's rows of a column-parallel
layer; A's columns of a row-parallel one, whose products are then partial sums like
its own). Which slot each row of a step takes is the step's ``LoraContext``, set by
the forward before the model runs (engine_worker/forward.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class LoraContext:
    """The adapters' slots of the current step's token rows (0: none), as groups."""

    def __init__(self) -> None:
        self.num_rows = 0
        # (slot, the rows that take it: None for every row) of each slot in the step
        self.groups: list[tuple[int, Optional[torch.Tensor]]] = []

    def set_rows(self, slots: Sequence[int], device: torch.device) -> None:
        """Each token row's slot, in the step's row order."""
        self.num_rows = len(slots)
        present = sorted(set(slots) - {0})
        if not present:
            self.groups = []
        elif len(present) == 1 and 0 not in slots:
            self.groups = [(present[0], None)]
        else:
            t = torch.tensor(slots, device=device)
            self.groups = [(s, torch.nonzero(t == s).flatten()) for s in present]

    def clear(self) -> None:
        self.num_rows, self.groups = 0, []


class LoraWeights:
    """One layer's adapters, by slot: A (r, in), B (out, r), scaling in B."""

    def __init__(self, context: LoraContext) -> None:
        self.context = context
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (N, out), the layer's output for x (N, in), with each row's adapter's
        product added."""
        context = self.context
        if not context.groups or x.shape[0] != context.num_rows:
            return y   # (rows other than the step's: the logits' rows, an expert's)
        for slot, rows in context.groups:
            ab = self.slots.get(slot)
            if ab is None:   # (an adapter that does not target this layer)
                continue
            a, b = ab
            if rows is None:
                y = y + (x @ a.t()) @ b.t()
            else:
                y = y.index_add(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y
