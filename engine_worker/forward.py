"""A step's forward pass: what a platform runs it with (``Forward``), eagerly here,
from CUDA graphs (gpu/graphs.py) or in the CPU's one C call (cpu/fused.py).

Every forward takes the scheduled requests in the scheduler's order, the placeholders
whose ids are on the device only (the engine's run-ahead: ``fills``, ids in
``tokens``) and the rows whose logits are wanted besides the samples (``extra``:
prompt logprobs, speculation's proposals), and returns the logits of the samples in
schedule order, then the extra rows' in their order (None when there is no row). A
request at index i of the step has its tokens' rows at first_rows[i] on; how the
rows are laid out is the forward's own (``StepRows``: single-token queries first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from engine_worker.models.layers.lora import LoraContext
from engine_worker.scheduler import ScheduledRequest
from engine_worker.step_inputs import StepInputs, step_layout

# (index in scheduled, offset in its tokens this step, index in the device's tokens)
Fill = tuple[int, int, int]
# (index in scheduled, offset in its tokens this step)
Row = tuple[int, int]


class Forward(Protocol):
    def __call__(self, scheduled: Sequence[ScheduledRequest], fills: Sequence[Fill],
                 tokens: Optional[torch.Tensor], extra: Sequence[Row]
                 ) -> Optional[torch.Tensor]: ...

    def serves_lora(self) -> bool:
        """Whether steps with LoRA adapters' rows may run here (else eagerly)."""


@dataclass
class StepRows:
    """A step laid out flat as the attention metadata wants it (step_layout)."""
    # the requests in the layout's order
    layout: list[ScheduledRequest]
    # the rows of the samples, in schedule order, and of the extra logits
    sampled: list[int]
    extra: list[int]
    # (row, index in the device's tokens) of each placeholder
    fills: list[tuple[int, int]]

    @classmethod
    def of(cls, scheduled: Sequence[ScheduledRequest], fills: Sequence[Fill],
           extra: Sequence[Row]) -> "StepRows":
        order, first_rows = step_layout(scheduled)
        return cls([scheduled[i] for i in order],
                   [first_rows[i] + s.num_tokens - 1 for i, s in enumerate(scheduled)
                    if s.samples],
                   [first_rows[i] + offset for i, offset in extra],
                   [(first_rows[i] + offset, source) for i, offset, source in fills])

    @property
    def num_decode(self) -> int:
        return sum(1 for s in self.layout if s.num_tokens == 1)


def pool(layout: Sequence[ScheduledRequest], hidden: torch.Tensor) -> None:
    """Embedding requests (Request.embed) take their rows' final hidden states:
    the last one ("last") or their sum ("mean"), kept on the request."""
    at = 0
    for s in layout:
        r = s.request
        if r.embed is not None:
            rows = hidden[at:at + s.num_tokens].float()
            start = r.num_computed_tokens   # (this step's first position)
            if start == 0:   # (from the start: again, after a preemption)
                r.pooled, r.pooled_upto = None, 0
            if r.embed == "last":
                r.pooled = rows[-1].clone()
            elif start + s.num_tokens > r.pooled_upto:   # (rows pooled once each)
                total = rows[max(0, r.pooled_upto - start):].sum(0)
                r.pooled = total if r.pooled is None else r.pooled + total
            r.pooled_upto = max(r.pooled_upto, start + s.num_tokens)
        at += s.num_tokens


def unit_vector(pooled: torch.Tensor) -> Optional[list[float]]:
    """An embedding request's vector: its pooled rows (their sum for "mean" pooling,
    whose direction is their mean's) normalized, or None where that is not finite."""
    vector = torch.nn.functional.normalize(pooled, dim=0)
    return vector.tolist() if torch.isfinite(vector).all() else None


class EagerForward:
    """The model's modules, layer by layer (its attention backend, its ops), on the
    step's inputs in persistent buffers (step_inputs.py)."""

    def __init__(self, model: nn.Module, inputs: StepInputs, kv_caches: list[torch.Tensor],
                 splits: Callable[[int], int]) -> None:
        """kv_caches: each layer's (the runner's list, filled once the cache is sized);
        splits: programs each decode row's context is split over (the platform's)."""
        self.model, self.inputs, self.kv_caches, self.splits = model, inputs, kv_caches, splits
        # LoRA adapters' rows (models/layers/lora.py): set for each step that has any
        self.lora: Optional[LoraContext] = None
        # the step has embedding requests' rows to pool (set by ModelRunner.forward)
        self.pooling = False

    def serves_lora(self) -> bool:
        return True

    def __call__(self, scheduled: Sequence[ScheduledRequest], fills: Sequence[Fill],
                 tokens: Optional[torch.Tensor], extra: Sequence[Row]
                 ) -> Optional[torch.Tensor]:
        return self.run(StepRows.of(scheduled, fills, extra), tokens)

    def run(self, rows: StepRows, tokens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        batch = self.inputs.prepare(rows.layout, rows.sampled + rows.extra, len(rows.sampled),
                                    num_splits=self.splits(rows.num_decode), fills=rows.fills)
        batch.fill_ids(tokens)
        lora = self.lora
        if lora is not None and lora.active:
            lora.set_rows([s.request.lora_slot for s in rows.layout
                           for _ in range(s.num_tokens)], batch.input_ids.device)
        try:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        finally:
            if lora is not None:
                lora.clear()
        logits = self.logits(hidden, batch)
        if self.pooling:
            pool(rows.layout, hidden)   # (once the step's forward is through)
        return logits

    def logits(self, hidden: torch.Tensor, batch) -> Optional[torch.Tensor]:
        """The logits of a step's rows that want them, from its final hidden states."""
        if not batch.logits_rows.numel():
            return None
        return self.model.compute_logits(hidden.index_select(0, batch.logits_rows))

    def logits_of(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                  logits_rows: Optional[torch.Tensor]) -> torch.Tensor:
        """The logits of ``logits_rows`` (every row's when None) of a step already in
        the input buffers: what a CUDA graph captures (gpu/graphs.py)."""
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            if logits_rows is not None:
                hidden = hidden.index_select(0, logits_rows)
            return self.model.compute_logits(hidden)
