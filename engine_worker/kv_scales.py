"""An fp8 KV cache's scales: each layer's keys are cached as k / k_scale and its values
as v / v_scale, so that what a layer writes spans float8 e4m3's range (±448) instead of
saturating at it or wasting it. A checkpoint's own scales are used where it has them
(compressed-tensors' kv_cache_scheme: ``self_attn.k_scale`` and ``v_scale``, or the
projections' ``output_scale``); otherwise the first step that computes prompt tokens
sets them from its keys and values (their largest magnitude, with room for the
prompts that follow, maps to 448: engine_worker.ops.calibrate_kv_scale) and they stay fixed from then on: a block's bytes
mean the same for the life of the engine, so the prefix cache and KV transfer keep
working: engines whose scales differ exchange no blocks (``signature``), but a decode
engine whose scales are not set yet takes its prefill engine's with their first blocks
(``adopt``), so prefill/decode engines share one set.

Attention (models/layers/attention.py) divides as it writes (the ops' rope_write_kv)
and multiplies back as it reads: the queries by k_scale, the output by v_scale.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Optional

import torch
from torch import nn

from engine_worker.models.layers.attention import Attention

logger = logging.getLogger(__name__)


class KvScales:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        """Each attention layer of ``model`` given its scales (its checkpoint's, where
        every layer has them; else 1 until ``calibrate_next``)."""
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        given = [m.checkpoint_kv_scale for m in self.layers]
        self.from_checkpoint = bool(given) and all(g is not None for g in given)
        for layer, scale in zip(self.layers, given):
            layer.kv_scale = (scale if self.from_checkpoint else torch.ones(2)).to(
                device=device, dtype=torch.float32)
        self.calibrating = False
        # set: from the checkpoint, the first prompt or a peer's blocks (adopt)
        self.fixed = self.from_checkpoint
        self._values: Optional[list[float]] = None
        self._signature = self._digest() if self.fixed else UNCALIBRATED

    def calibrate_next(self) -> None:
        """The next step that computes prompt tokens sets the scales (not a warm-up's
        made-up tokens: this is called once serving starts)."""
        if not self.from_checkpoint:
            self.calibrating = True
            for layer in self.layers:
                layer.kv_calibrating = True

    def calibrated(self, source: str = "the first prompts") -> None:
        """After that step (or a peer's scales taken): the scales are fixed."""
        self.calibrating, self.fixed = False, True
        for layer in self.layers:
            layer.kv_calibrating = False
        self._signature = self._digest()
        scales = torch.stack([layer.kv_scale for layer in self.layers]).cpu()
        self._values = scales.flatten().tolist()
        logger.info("fp8 KV cache scales set from %s: keys %.3g-%.3g, values %.3g-%.3g over "
                    "%d layers", source, scales[:, 0].min(), scales[:, 0].max(),
                    scales[:, 1].min(), scales[:, 1].max(), len(self.layers))

    def signature(self) -> str:
        """What a peer's fp8 blocks must have been written with to mean the same here."""
        return self._signature

    def values(self) -> list[float]:
        """Each layer's key scale, then its value scale (what KvBlocks carries; read
        from the device once they are fixed)."""
        if self.fixed and self._values is not None:
            return self._values
        return torch.stack([layer.kv_scale for layer in self.layers]).flatten().tolist()

    def adopt(self, values: list[float]) -> bool:
        """A peer's scales, which its blocks were written with: taken where this
        engine's are not set yet (a decode engine before its first prompt); else
        whether they are this engine's."""
        if self.fixed:
            return values == self.values()
        if len(values) != 2 * len(self.layers):
            return False
        given = torch.tensor(values, dtype=torch.float32).view(-1, 2)
        for layer, scale in zip(self.layers, given):
            layer.kv_scale.copy_(scale)
        self.calibrated("a peer's blocks")
        return True

    def _digest(self) -> str:
        scales = torch.stack([layer.kv_scale for layer in self.layers]).cpu()
        return "scales=" + hashlib.sha256(scales.numpy().tobytes()).hexdigest()[:16]


# The signature of scales not set yet (KvBlockStore.layout)
UNCALIBRATED = "uncalibrated"
