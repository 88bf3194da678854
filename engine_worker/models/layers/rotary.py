"""Rotary position embeddings: each position's cos and sin, from a RopeConfig's
frequencies (its base and scaling: linear, Llama 3.1's, YaRN, LongRoPE), in Hugging
Face's rotate-half convention; and where RoPE turns only part of each head, the order
of q's and k's rows that makes the kernels' full-head RoPE turn just that part."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

import torch

from engine_worker.models.rope import RopeConfig

if TYPE_CHECKING:
    from engine_worker.models.config import ModelConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,), scaled as the rope type says."""
    # Explicit device: models are built under torch.device("meta").
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
        # band between them interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
    if rope.kind == "longrope":
        return inv_freq / torch.tensor(rope.ext_factors, dtype=torch.float32, device="cpu")
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context
    are interpolated (slowed by the factor), those that turn more than beta_fast times
    kept, and the band between them blended along a linear ramp."""
    def dimension(rotations: float) -> float:
        # the dimension whose wavelength fits ``rotations`` times in the original context
        return (head_dim * math.log(rope.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    # ramp 0: kept (extrapolated); 1: interpolated
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def partial_rotary_order(cfg: ModelConfig, num_heads: Optional[int] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where RoPE turns only a head's first R dimensions (pairs i and i + R/2): the
    order of q's and k's rows in the fused q/k/v weight (q's heads, then k's), and of
    a head's dimensions (its norms'), that puts those pairs where the kernels'
    full-head RoPE turns pairs (i and i + D/2, for i < R/2), and the rest where Rotary
    gives frequency 0. Each head alike, q and k alike, so q.k is unchanged.
    num_heads: q's and k's heads in the weight (a rank's, where the model is split;
    default: the model's)."""
    d, half, r = cfg.head_dim, cfg.head_dim // 2, cfg.rotary_dim // 2
    rest = list(range(2 * r, d))
    order = torch.tensor(list(range(r)) + rest[:half - r]
                         + list(range(r, 2 * r)) + rest[half - r:])
    heads = torch.arange(num_heads or cfg.num_heads + cfg.num_kv_heads).unsqueeze(1) * d
    return (heads + order).flatten(), order


class Rotary:
    """cos/sin of each position, computed per step from the positions (as Hugging Face
    does) rather than from a table, so the numbers match bit for bit."""

    def __init__(self, rope: RopeConfig, head_dim: int, rotary_dim: Optional[int] = None
                 ) -> None:
        """rotary_dim: the dimensions RoPE turns, where not all: their frequencies come
        first (the loader moved them there: reorder_partial_rotary), the
        others' are 0 (cos 1, sin 0: left as they are)."""
        turned, half = (rotary_dim or head_dim) // 2, head_dim // 2
        self.inv_freq = rope_inv_freq(rope, rotary_dim or head_dim)  # (D/2,), float32
        # YaRN's and LongRoPE's attention factor multiplies cos and sin (1 for the other
        # kinds), of the dimensions turned only
        self.scale: Union[float, torch.Tensor] = rope.attention_factor
        if turned < half:   # explicit device: models are built under torch.device("meta")
            self.inv_freq = torch.cat([self.inv_freq, torch.zeros(half - turned, device="cpu")])
            if rope.attention_factor != 1.0:
                self.scale = torch.ones(half, device="cpu")
                self.scale[:turned] = rope.attention_factor

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N,) -> cos, sin (N, D/2)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            if isinstance(self.scale, torch.Tensor):
                self.scale = self.scale.to(positions.device)
        freqs = positions.float().unsqueeze(1) * self.inv_freq
        if isinstance(self.scale, torch.Tensor) or self.scale != 1.0:
            return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


@torch.no_grad()
def reorder_partial_rotary(attn, cfg: ModelConfig) -> None:
    """An attention layer's loaded weights put in partial_rotary_order: q's and k's
    rows of the fused q/k/v weight (and bias), and a head's dimensions of the q and k
    norms (v, and so every output, is untouched)."""
    rows, order = partial_rotary_order(cfg, attn.num_heads + attn.num_kv_heads)
    attn.qkv_proj.reorder_outputs(rows)
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            norm.weight.copy_(norm.weight[order.to(norm.weight.device)])
