"""Fused layer operations, with a pure-torch implementation for every device.

The decoder layers call these through an ``ops`` object (``Ops``): ``TorchOps`` below
(any device), ``CpuKernels`` (engine_worker/cpu/kernels.py: the same methods in C) or
``TritonOps`` (engine_worker/gpu/ops.py), as the platform chose (platform.py).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft cap, cap tanh(x / cap), in place (x itself where cap is 0)."""
    return x.div_(cap).tanh_().mul_(cap) if cap else x


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' gate: (N, 2 I) holding gate then up -> (clamp(up, -limit,
    limit) + 1) g sigmoid(alpha g), g = min(gate, limit), (N, I); in transformers'
    order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, H, D) rotated by cos, sin (N, 1, D/2), rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q (N, Hq, D), k and v (N, Hkv, D) of the fused projection (N, (Hq + 2 Hkv) D)."""
    n = qkv.shape[0]
    q_end = num_heads * head_dim
    k_end = q_end + num_kv_heads * head_dim
    return (qkv[:, :q_end].view(n, num_heads, head_dim),
            qkv[:, q_end:k_end].view(n, num_kv_heads, head_dim),
            qkv[:, k_end:].view(n, num_kv_heads, head_dim))


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: an fp8 cache holds keys and values within +-448


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the cache's dtype; to fp8 saturating at its largest finite value
    (as the Triton kernels do), not overflowing to NaN, and a NaN written as 0: an fp8
    cache holds no NaN, so that the attention kernel reads the values of a tile's keys
    past a context unmasked (their probability is 0, and 0 times a finite value is 0;
    the blocks start zeroed)."""
    if dtype != FP8:
        return x.to(dtype)
    return torch.nan_to_num(x, nan=0.0).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def value_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The values of one layer's cache (2, num_blocks, bs, Hkv, D) as its blocks hold
    them: (num_blocks, bs, Hkv, D) like the keys, but in an fp8 cache (num_blocks, Hkv,
    D, bs), each block's tokens innermost. The attention kernel's second product reads
    values along the tokens, and Hopper's tensor cores take 8-bit operands only laid
    out along the axis they sum over (docs/performance.md, "An fp8 KV cache")."""
    if kv_cache.dtype != FP8:
        return kv_cache[1]
    _, num_blocks, bs, h_kv, d = kv_cache.shape
    return kv_cache[1].view(num_blocks, h_kv, d, bs)


def to_value_blocks(v: torch.Tensor) -> torch.Tensor:
    """Values (num_blocks, bs, Hkv, D) laid out as value_blocks holds them."""
    return v.permute(0, 2, 3, 1).contiguous() if v.dtype == FP8 else v


def from_value_blocks(v: torch.Tensor) -> torch.Tensor:
    """value_blocks' values as (num_blocks, bs, Hkv, D), a view."""
    return v.permute(0, 3, 1, 2) if v.dtype == FP8 else v


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k and v (N, Hkv, D) into their slots of one layer's cache."""
    h_kv, d = k.shape[1:]
    k, v = to_cache_dtype(k, kv_cache.dtype), to_cache_dtype(v, kv_cache.dtype)
    if kv_cache.dtype != FP8:
        for cache, x in zip(kv_cache, (k, v)):
            cache.view(-1, h_kv, d).index_copy_(0, slot_mapping, x)
        return
    # torch has no index_copy_ for fp8: copy its bytes
    kv_cache[0].view(torch.uint8).view(-1, h_kv, d).index_copy_(0, slot_mapping,
                                                                  k.view(torch.uint8))
    bs = kv_cache.shape[2]
    value_blocks(kv_cache).view(torch.uint8)[slot_mapping // bs, :, :, slot_mapping % bs] = (
        v.view(torch.uint8))


# An fp8 cache's first prompts' largest key or value maps to 448 / HEADROOM: room for
# later ones up to HEADROOM times larger before they saturate (fp8 keeps 3 mantissa
# bits at every magnitude down to 2^-6 of its scale, so the headroom costs no precision)
HEADROOM = 2.0


def calibrate_kv_scale(scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       amax_over: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                       ) -> None:
    """Sets a layer's fp8 cache's (key, value) scales from this step's keys and values
    (on the device, no sync; engine_worker/kv_scales.py) and rewrites them into the
    cache by the new scales. ``amax_over``: the largest over the tensor-parallel ranks
    (each holds some heads; the scales are the layer's, as one engine's)."""
    amax = torch.stack((k.abs().amax(), v.abs().amax())).float()
    if amax_over is not None:
        amax = amax_over(amax)
    scale.copy_((amax * HEADROOM / FP8_MAX).clamp(min=1e-8))
    written = slot_mapping >= 0   # (a padded row writes nothing)
    write_kv(kv_cache, k[written] / scale[0], v[written] / scale[1], slot_mapping[written])


# Qwen3's q and k norms: (q's weight, k's weight, eps); each head RMS-normed before RoPE.
QkNorm = tuple[torch.Tensor, torch.Tensor, float]


def norm_heads(ops, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               qk_norm: QkNorm) -> None:
    """Each head of q and k in qkv (N, (Hq + 2 Hkv) D) RMS-normed in place by
    ``ops.add_rms_norm`` (the ops without a fused kernel for it)."""
    q_weight, k_weight, eps = qk_norm
    n = qkv.shape[0]
    for first, count, weight in ((0, num_heads, q_weight), (num_heads, num_kv_heads, k_weight)):
        heads = qkv[:, first * head_dim:(first + count) * head_dim]
        heads.copy_(ops.add_rms_norm(heads.reshape(-1, head_dim), None, weight, eps)[0]
                    .view(n, -1))


class Ops(Protocol):
    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      qk_norm: Optional[QkNorm] = None, kv_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float
                       ) -> torch.Tensor: ...


class TorchOps:
    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """h = x + residual (x alone when None); returns (RMSNorm(h) * weight, h)."""
        h = x if residual is None else x + residual
        h32 = h.float()
        normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(h.dtype), h

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      qk_norm: Optional[QkNorm] = None, kv_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (N, (Hq + 2 Hkv) D); cos, sin (N, D/2). Norms each head of q and k (with
        ``qk_norm``), rotates them, writes k and v into their cache slots (an fp8
        cache's divided by ``kv_scale``'s key and value scales: kv_scales.py); returns
        q (N, Hq, D), k and v (N, Hkv, D), unscaled."""
        if qk_norm is not None:
            norm_heads(self, qkv, num_heads, num_kv_heads, head_dim, qk_norm)
        n = qkv.shape[0]
        q_end = num_heads * head_dim
        k_end = q_end + num_kv_heads * head_dim
        qk = qkv[:, :k_end].view(n, num_heads + num_kv_heads, head_dim)
        qk = apply_rotary(qk, cos.unsqueeze(1), sin.unsqueeze(1))
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, k_end:].view(n, num_kv_heads, head_dim)
        if kv_scale is None:
            write_kv(kv_cache, k, v, slot_mapping)
        else:
            write_kv(kv_cache, k / kv_scale[0], v / kv_scale[1], slot_mapping)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(N, 2 I) holding gate then up -> silu(gate) * up, (N, I)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(N, 2 I) holding gate then up -> gelu(gate) * up with GELU's tanh form
        (Gemma's gelu_pytorch_tanh), (N, I)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    clamped_swiglu = staticmethod(clamped_swiglu)
