"""LoRA adapters on the linear layers, many in one batch: each token row's adapter
adds its low-rank product (x A^T) B^T, scaled, to the layer's output, grouped by
adapter, never merged into the weights (as S-LoRA and Punica do), so that requests
of different adapters and of none share every step.

A layer an adapter targets holds that adapter's A (r, in) and B (out, r) by slot
(``LoraWeights``, which computes a step's products for all of them in two matmuls); a
fused layer's (q, k and v; gate and up) are its parts' stacked: A's rows one part's
after another, B block-diagonal. B carries the adapter's scaling (alpha / r, or
alpha / sqrt(r) for rsLoRA) and what the loader did to the layer's outputs (a residual
multiplier folded in, rows reordered for a partial RoPE), and a layer split over
tensor-parallel ranks holds its part (B's rows of a column-parallel layer; A's columns
of a row-parallel one, whose products are then partial sums like its own). Which slot
each row of a step takes is the step's ``LoraContext``, set by the forward before the
model runs (engine_worker/forward.py). The CPU's one-call forward computes the same
products inside its call, from ``LoraWeights.packed`` (cpu/fused.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class LoraContext:
    """The adapters' slots of the current step's token rows (0: none)."""

    def __init__(self) -> None:
        self.num_rows = 0
        self.slots: Optional[torch.Tensor] = None   # (N,) int64, or None: no adapter rows
        self.only = 0
        # this step has adapters' rows (set by ModelRunner.forward for the step's forward)
        self.active = False
        # bumped by every adapter's load and unload, on any layer (what the C forward
        # holds pointers to is then stale: cpu/fused.py)
        self.version = 0
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def set_rows(self, slots: Sequence[int], device: torch.device) -> None:
        """Each token row's slot, in the step's row order."""
        self.num_rows = len(slots)
        self.slots = torch.tensor(slots, device=device) if any(slots) else None
        # every row the same adapter's: its own product, unmasked
        self.only = slots[0] if self.slots is not None and len(set(slots)) == 1 else 0
        self._masks = {}

    def clear(self) -> None:
        self.num_rows, self.slots, self.only, self._masks = 0, None, 0, {}

    def mask(self, rank: int, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """(N, num_slots x rank): 1 where a column's slot (``rank`` columns a slot,
        slot 1 first) is its row's, else 0 (made once a step for each layout)."""
        key = (rank, num_slots, dtype)
        if key not in self._masks:
            assert self.slots is not None
            columns = torch.arange(num_slots * rank, device=self.slots.device) // rank + 1
            self._masks[key] = (self.slots[:, None] == columns[None, :]).to(dtype)
        return self._masks[key]


class LoraWeights:
    """One layer's adapters, by slot: A (r, in), B (out, r), scaling in B.

    A step computes every row's product for every loaded adapter at once: x times
    every slot's A stacked (one matmul to N x slots x R, R the layer's largest rank,
    zero-padded), masked to each row's own slot's columns, times every slot's B
    stacked (one matmul back to N x out): two matmuls a layer whatever the adapters in
    the step, where a loop over them cost four small ops each (0.40x the base model's
    tokens/s with 8 streams over 4 adapters, against 0.61x)."""

    def __init__(self, context: LoraContext, row_part: Optional[torch.Tensor] = None
                 ) -> None:
        """row_part: a fused layer's part (0, 1, ...) of each output row, as its
        outputs are ordered; None: one part."""
        self.context = context
        self.row_part = row_part
        # slot -> (A, B, each part's rank: its rows of A and columns of B, in turn)
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}
        self._stacked: Optional[tuple[torch.Tensor, torch.Tensor, int, int]] = None
        self._packed: Optional[tuple] = None

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor,
            ranks: Optional[tuple[int, ...]] = None) -> None:
        self.slots[slot] = (a, b, (a.shape[0],) if ranks is None else tuple(ranks))
        self._stacked = self._packed = None
        self.context.version += 1

    def drop(self, slot: int) -> None:
        if slot not in self.slots:
            return
        del self.slots[slot]
        self._stacked = self._packed = None
        self.context.version += 1

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(every slot's A stacked (S R, in), B side by side (out, S R), R, S)."""
        if self._stacked is None:
            rank = max(a.shape[0] for a, _, _ in self.slots.values())
            num = max(self.slots)
            a0, b0, _ = next(iter(self.slots.values()))
            a_all = a0.new_zeros(num * rank, a0.shape[1])
            b_all = b0.new_zeros(b0.shape[0], num * rank)
            for slot, (a, b, _) in self.slots.items():
                at = (slot - 1) * rank
                a_all[at:at + a.shape[0]] = a
                b_all[:, at:at + a.shape[0]] = b
            self._stacked = (a_all, b_all, rank, num)
        return self._stacked

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
        """The C forward's layout (cpu/csrc/llama.c, struct rs_lora), float32: (A
        (S, P R, in), each part's R rows in turn; B (S, out, R), each output row its
        part's columns alone (not block-diagonal); each row's part (out,) int32; R, P,
        S), R the largest part's rank, P the parts, S the largest slot."""
        if self._packed is None:
            a0, b0, ranks0 = next(iter(self.slots.values()))
            parts = len(ranks0)
            row_part = (torch.zeros(b0.shape[0], dtype=torch.int32) if self.row_part is None
                        else self.row_part.to(torch.int32))
            # (the C reads t's part of each row: every slot has the layer's parts)
            assert all(len(ranks) == parts for _, _, ranks in self.slots.values())
            assert row_part.shape == (b0.shape[0],) and int(row_part.max()) < parts
            rank = max(max(ranks) for _, _, ranks in self.slots.values())
            num = max(self.slots)
            a_all = torch.zeros(num, parts * rank, a0.shape[1])
            b_all = torch.zeros(num, b0.shape[0], rank)
            for slot, (a, b, ranks) in self.slots.items():
                col = 0
                for part, r in enumerate(ranks):
                    rows = row_part == part
                    a_all[slot - 1, part * rank:part * rank + r] = a[col:col + r].float()
                    b_all[slot - 1, rows, :r] = b[rows, col:col + r].float()
                    col += r
            self._packed = (a_all, b_all, row_part.contiguous(), rank, parts, num)
        return self._packed

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (N, out), the layer's output for x (N, in), with each row's adapter's
        product added."""
        context = self.context
        if context.slots is None or not self.slots or x.shape[0] != context.num_rows:
            return y   # (rows other than the step's: the logits' rows, an expert's)
        if context.only:
            ab = self.slots.get(context.only)
            return y if ab is None else y + (x @ ab[0].t()) @ ab[1].t()
        a, b, rank, num = self.stacked()
        shrunk = (x @ a.t()) * context.mask(rank, num, x.dtype)
        return y + shrunk @ b.t()
