"""The Llama family's elementwise layer ops as Triton kernels: the methods of
engine_worker.ops.TorchOps, one launch each instead of several torch ops.

Each rounds where the torch version rounds (a residual sum and a normalized row in
the activation dtype before the weight multiplies it; silu before the product), and
computes the rest in float32. RoPE rotates q and k in place inside the qkv
activations (Qwen3's per-head q and k norms first, in the same launch: two norm
launches, two copies and a concatenation a layer fewer) and writes k and v into their
cache slots; a slot of -1 (a padded row of a CUDA graph's batch) writes nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine_worker.ops import QkNorm, split_qkv


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, h_ptr, eps,
                         stride_x, stride_r, stride_o, stride_h, C: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < C
    h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + row * stride_h + cols, h, mask=ok)
    h32 = h.to(tl.float32)
    normed = h32 * tl.rsqrt(tl.sum(h32 * h32, 0) / C + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = w * normed.to(h.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _to_cache(x, cache_ptr):
    """x in the cache's dtype. An fp8 cache (float8 e4m3) saturates at +-448, its
    largest finite value, and holds a NaN as 0, as the torch path does
    (engine_worker.ops.to_cache_dtype)."""
    if cache_ptr.dtype.element_ty.is_fp8():
        x = x.to(tl.float32)
        x = tl.where(x == x, tl.clamp(x, -448.0, 448.0), 0.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          q_norm_ptr, k_norm_ptr, scale_ptr, eps, stride_t, stride_cs,
                          stride_slot, stride_head, NUM_HEADS: tl.constexpr,
                          NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                          HALF: tl.constexpr, HALF_PAD: tl.constexpr, PAGE: tl.constexpr,
                          QK_NORM: tl.constexpr, SCALED: tl.constexpr = False):
    """One program per token, all its heads at once (rows: q heads, then k, then v).
    QK_NORM: each head of q and k RMS-normed first (Qwen3), rounded as add_rms_norm
    rounds. The caches are contiguous; an fp8 cache's values lie (Hkv, D, PAGE) in each
    block (engine_worker.ops.value_blocks). SCALED: keys and values divided by the
    layer's scales (scale_ptr: the key's, the value's) as they are written."""
    t = tl.program_id(0)
    head = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    ok = (head < NUM_HEADS + 2 * NUM_KV_HEADS) & (i < HALF)
    base = qkv_ptr + t * stride_t + head * (2 * HALF)
    x1 = tl.load(base + i, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
    cos = tl.load(cos_ptr + t * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    # q and k rotate (rotate-half convention), rounded to the activations' dtype; v not.
    rotates = head < NUM_HEADS + NUM_KV_HEADS
    if QK_NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        is_q = head < NUM_HEADS
        w1 = tl.where(is_q, tl.load(q_norm_ptr + i, mask=i < HALF, other=0.0),
                      tl.load(k_norm_ptr + i, mask=i < HALF, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_norm_ptr + HALF + i, mask=i < HALF, other=0.0),
                      tl.load(k_norm_ptr + HALF + i, mask=i < HALF, other=0.0)).to(tl.float32)
        x1 = tl.where(rotates, (w1 * (a * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype), x1)
        x2 = tl.where(rotates, (w2 * (b * rstd).to(x2.dtype).to(tl.float32)).to(x2.dtype), x2)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = tl.where(rotates, (a * cos - b * sin).to(x1.dtype), x1)
    y2 = tl.where(rotates, (b * cos + a * sin).to(x2.dtype), x2)
    tl.store(base + i, y1, mask=ok & rotates)
    tl.store(base + HALF + i, y2, mask=ok & rotates)
    # k and v into their cache slot; a slot of -1 (a padded row) writes nothing.
    slot = tl.load(slot_ptr + t)
    is_k = (head >= NUM_HEADS) & rotates
    is_v = ok & ~rotates
    kv_head = tl.where(is_k, head - NUM_HEADS, head - NUM_HEADS - NUM_KV_HEADS)
    dst = slot.to(tl.int64) * stride_slot + kv_head * stride_head + i
    # (Folded into a bound, not and-ed as a scalar: the interpreter turns tensor &
    # scalar-bool into integers.)
    write = ok & (i < tl.where(slot >= 0, HALF, 0))
    k1, k2, v1, v2 = y1, y2, y1, y2
    if SCALED:
        k_scale, v_scale = tl.load(scale_ptr), tl.load(scale_ptr + 1)
        k1, k2 = y1.to(tl.float32) / k_scale, y2.to(tl.float32) / k_scale
        v1, v2 = y1.to(tl.float32) / v_scale, y2.to(tl.float32) / v_scale
    tl.store(k_cache_ptr + dst, _to_cache(k1, k_cache_ptr), mask=write & is_k)
    tl.store(k_cache_ptr + dst + HALF, _to_cache(k2, k_cache_ptr), mask=write & is_k)
    if v_cache_ptr.dtype.element_ty.is_fp8():
        at = slot.to(tl.int64)
        dst = ((at // PAGE) * (stride_slot * PAGE) + kv_head * (stride_head * PAGE)
               + i * PAGE + at % PAGE)
        second = HALF * PAGE
    else:
        second = HALF
    tl.store(v_cache_ptr + dst, _to_cache(v1, v_cache_ptr), mask=write & is_v)
    tl.store(v_cache_ptr + dst + second, _to_cache(v2, v_cache_ptr), mask=write & is_v)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, WIDTH: tl.constexpr,
                     BLOCK: tl.constexpr, GELU: tl.constexpr = False,
                     LIMIT: tl.constexpr = 0.0, ALPHA: tl.constexpr = 1.0):
    """silu(gate) * up, or with GELU gelu(gate) * up in its tanh form: x sigmoid(2 y),
    y = sqrt(2 / pi) (x + 0.044715 x^3), which is 0.5 x (1 + tanh y); with LIMIT > 0
    gpt-oss's clamped SwiGLU (engine_worker.ops.clamped_swiglu)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if LIMIT > 0:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(up.to(tl.float32), -LIMIT), LIMIT) + 1.0
        out = u * (g / (1.0 + tl.exp(-ALPHA * g)))
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
        return
    if GELU:
        act = (g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
               ).to(gate.dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


class TritonOps:
    """engine_worker.ops.TorchOps's methods, on the GPU (or Triton's interpreter)."""

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """h = x + residual (x alone when None); returns (RMSNorm(h) * weight, h)."""
        n, c = x.shape
        out = torch.empty_like(x)
        h = x if residual is None else torch.empty_like(x)
        r = x if residual is None else residual
        if n:
            _add_rms_norm_kernel[(n,)](
                x, r, weight, out, h, eps, x.stride(0), r.stride(0), out.stride(0),
                h.stride(0), C=c, BLOCK=triton.next_power_of_2(c),
                HAS_RESIDUAL=residual is not None, num_warps=_warps(c))
        return out, h

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      qk_norm: Optional[QkNorm] = None, kv_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (N, (Hq + 2 Hkv) D), normed (with ``qk_norm``) and rotated in place; cos,
        sin (N, D/2); kv_cache (2, num_blocks, page, Hkv, D), an fp8 one's keys and
        values divided by ``kv_scale``'s as they are written. Returns views q (N, Hq,
        D), k and v (N, Hkv, D)."""
        n = qkv.shape[0]
        assert qkv.stride(1) == 1 and kv_cache.is_contiguous()
        k_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # (slots, Hkv, D)
        v_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        half = head_dim // 2
        if n:
            heads_pad = triton.next_power_of_2(num_heads + 2 * num_kv_heads)
            q_norm, k_norm, eps = qk_norm or (qkv, qkv, 0.0)   # (not read without)
            _rope_write_kv_kernel[(n,)](
                qkv, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm,
                kv_scale if kv_scale is not None else cos, eps,
                qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
                NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad,
                HALF=half, HALF_PAD=triton.next_power_of_2(half), PAGE=kv_cache.shape[2],
                QK_NORM=qk_norm is not None, SCALED=kv_scale is not None,
                num_warps=_rope_warps(heads_pad * half))
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(N, 2 I) holding gate then up -> silu(gate) * up, (N, I)."""
        return self._act_mul(gate_up, gelu=False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(N, 2 I) holding gate then up -> gelu(gate) * up, GELU's tanh form."""
        return self._act_mul(gate_up, gelu=True)

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float
                       ) -> torch.Tensor:
        """gpt-oss's experts' gate (engine_worker.ops.clamped_swiglu)."""
        return self._act_mul(gate_up, gelu=False, limit=limit, alpha=alpha)

    def _act_mul(self, gate_up: torch.Tensor, gelu: bool, limit: float = 0.0,
                 alpha: float = 1.0) -> torch.Tensor:
        n, two_i = gate_up.shape
        i = two_i // 2
        out = gate_up.new_empty(n, i)
        block = min(1024, triton.next_power_of_2(i))
        if n:
            _silu_mul_kernel[(n, triton.cdiv(i, block))](
                gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=i, BLOCK=block,
                GELU=gelu, LIMIT=float(limit), ALPHA=float(alpha))
        return out


def _warps(width: int) -> int:
    return 4 if width <= 2048 else 8


def _rope_warps(elements: int) -> int:
    """Warps for a token's heads x half a head: about 16 values a thread a half."""
    return max(1, min(8, elements // 512))
