"""The Triton layer ops against TorchOps, the reference every device runs."""

from __future__ import annotations

import pytest
import torch

from engine_worker.gpu.ops import TritonOps
from engine_worker.ops import (FP8, TorchOps, apply_rotary, from_value_blocks, split_qkv,
                               to_cache_dtype, value_blocks)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(with_residual):
    x, residual, weight = randn(5, 96), randn(5, 96, seed=1), randn(96, seed=2)
    ref_out, ref_h = TorchOps().add_rms_norm(x, residual if with_residual else None,
                                             weight, 1e-5)
    out, h = TritonOps().add_rms_norm(x, residual if with_residual else None, weight, 1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk-norm"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (3, 1)], ids=["gqa", "mha", "gqa3"])
def test_rope_write_kv_matches_torch_and_skips_padded_slots(heads, qk_norm):
    """With qk_norm (Qwen3), each head of q and k RMS-normed by its weight first."""
    hq, hkv = heads
    d, page, num_blocks, n = 16, 4, 6, 7
    qkv = randn(n, (hq + 2 * hkv) * d)
    norms = (randn(d, seed=3), randn(d, seed=4), 1e-6) if qk_norm else None
    positions = torch.tensor([0, 1, 2, 9, 10, 3, 0], device=DEVICE)
    freqs = positions.float().unsqueeze(1) * (1e4 ** (-torch.arange(0, d, 2, device=DEVICE) / d))
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.tensor([5, 6, 7, 20, 21, 2, -1], device=DEVICE)  # the last row is padding
    ref_cache = torch.zeros(2, num_blocks, page, hkv, d, device=DEVICE)
    cache = torch.full_like(ref_cache, 7.0)
    ref_cache.fill_(7.0)
    real = slots >= 0
    q_ref, k_ref, v_ref = TorchOps().rope_write_kv(qkv[real].clone(), cos[real], sin[real],
                                                   hq, hkv, d, ref_cache, slots[real], norms)
    q, k, v = TritonOps().rope_write_kv(qkv, cos, sin, hq, hkv, d, cache, slots, norms)
    if qk_norm:   # the norms did something: the keys differ from the rotated inputs
        _, k_in, _ = split_qkv(randn(n, (hq + 2 * hkv) * d), hq, hkv, d)
        rotated = apply_rotary(k_in, cos.unsqueeze(1), sin.unsqueeze(1))
        assert not torch.allclose(k[real], rotated[real], atol=1e-2)
    torch.testing.assert_close(q[real], q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k[real], k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v[real], v_ref, rtol=0, atol=0)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)  # 7.0 where unwritten


def test_rope_write_kv_into_an_fp8_cache_saturates_as_the_torch_path_does():
    """--kv-cache-dtype fp8: keys and values become float8 e4m3 as they are written,
    and values past its largest finite value (448) are held at it, not made NaN. The
    inputs are fp8 values (and twice them, many past 448) at position 0, where the
    rotation is exact: Triton's interpreter rounds to fp8 wrongly where the mantissa
    carries into the exponent (127.65 to 64), which a GPU does not; the GPU tests
    round real values (test_bf16_ops_match_torch_at_real_shapes). (Saturated before
    the grid is taken: torch 2.11 turns a value past 448 into NaN, 2.13 into 448.)"""
    hq, hkv, d, n = 4, 2, 16, 5
    on_grid = to_cache_dtype(randn(n, (hq + 2 * hkv) * d) * 200, FP8).float()
    qkv = torch.cat([on_grid[:2], 2 * on_grid[2:]])
    cos = torch.ones(n, d // 2, device=DEVICE)
    sin = torch.zeros(n, d // 2, device=DEVICE)
    slots = torch.tensor([3, 4, 5, 6, 7], device=DEVICE)
    ref_cache = torch.zeros(2, 3, 4, hkv, d, device=DEVICE, dtype=torch.float8_e4m3fn)
    cache = torch.zeros_like(ref_cache)
    TorchOps().rope_write_kv(qkv.clone(), cos, sin, hq, hkv, d, ref_cache, slots)
    TritonOps().rope_write_kv(qkv, cos, sin, hq, hkv, d, cache, slots)
    written = cache.float()
    assert not written.isnan().any()
    assert (qkv.abs() > 448).any() and written.abs().max() == 448
    assert torch.equal(written, ref_cache.float())
    # each key and value in its slot, the values' blocks laid out (Hkv, D, page)
    _, k, v = split_qkv(qkv, hq, hkv, d)
    for got, want in zip(slot_contents(cache, slots), (k, v)):
        assert torch.equal(got.float(), want.clamp(-448, 448))


def test_rope_write_kv_divides_by_an_fp8_caches_scales_as_it_writes():
    """Keys and values written as k / k_scale and v / v_scale (engine_worker/kv_scales.py),
    by both paths; the returned ones as computed. Scales of powers of two keep the
    interpreter's conversions exact (as above)."""
    hq, hkv, d, n = 4, 2, 16, 5
    qkv = to_cache_dtype(randn(n, (hq + 2 * hkv) * d, seed=3) * 100, FP8).float()
    cos = torch.ones(n, d // 2, device=DEVICE)
    sin = torch.zeros(n, d // 2, device=DEVICE)
    slots = torch.tensor([3, 4, 5, 6, 7], device=DEVICE)
    scale = torch.tensor([0.5, 4.0], device=DEVICE)
    ref_cache = torch.zeros(2, 3, 4, hkv, d, device=DEVICE, dtype=torch.float8_e4m3fn)
    cache = torch.zeros_like(ref_cache)
    TorchOps().rope_write_kv(qkv.clone(), cos, sin, hq, hkv, d, ref_cache, slots, None, scale)
    _, k, v = TritonOps().rope_write_kv(qkv, cos, sin, hq, hkv, d, cache, slots, None, scale)
    assert torch.equal(cache.float(), ref_cache.float())
    got_k, got_v = slot_contents(cache, slots)
    assert torch.equal(got_k.float(), (k / 0.5).clamp(-448, 448))
    assert torch.equal(got_v.float(), v / 4.0)
    assert (k.abs() > 224).any()   # (held at 448 once doubled)


def test_an_fp8_cache_is_written_no_nan():
    """A NaN key or value is written to an fp8 cache as 0 and an infinite one as +-448,
    by both paths: the attention kernel reads the values of keys past a context
    unmasked (their probability is 0), which holds only while the cache has no NaN."""
    hq, hkv, d, n = 2, 1, 8, 3
    qkv = randn(n, (hq + 2 * hkv) * d)
    v_at, k_at = (hq + hkv) * d, hq * d
    qkv[0, v_at:v_at + 3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    qkv[1, k_at:k_at + d] = float("nan")  # a whole key, both halves of each pair
    cos = torch.ones(n, d // 2, device=DEVICE)
    sin = torch.zeros(n, d // 2, device=DEVICE)
    slots = torch.tensor([1, 2, 5], device=DEVICE)
    ref_cache = torch.full((2, 2, 4, hkv, d), 1.0, device=DEVICE).to(FP8)
    cache = ref_cache.clone()
    TorchOps().rope_write_kv(qkv.clone(), cos, sin, hq, hkv, d, ref_cache, slots)
    TritonOps().rope_write_kv(qkv.clone(), cos, sin, hq, hkv, d, cache, slots)
    for written in (ref_cache, cache):
        assert not written.float().isnan().any()
        k, v = slot_contents(written, slots)
        assert v[0, 0, :3].float().tolist() == [0.0, 448.0, -448.0]
        assert k[1].float().eq(0).all()
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


def slot_contents(cache: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
    """The keys and the values (N, Hkv, D) that one layer's cache holds at slots."""
    _, _, _, hkv, d = cache.shape
    return [cache[0].reshape(-1, hkv, d)[slots],
            from_value_blocks(value_blocks(cache)).reshape(-1, hkv, d)[slots]]


def test_silu_mul_matches_torch():
    x = randn(3, 2 * 1500)  # wider than one program's block
    torch.testing.assert_close(TritonOps().silu_mul(x), TorchOps().silu_mul(x),
                               rtol=1e-5, atol=1e-6)


def test_clamped_swiglu_matches_torch():
    """gpt-oss's gate, gate and up clamped at 1.5 (values of randn reach past it on
    both sides)."""
    x = randn(3, 2 * 1500)
    got = TritonOps().clamped_swiglu(x, alpha=1.702, limit=1.5)
    torch.testing.assert_close(got, TorchOps().clamped_swiglu(x, alpha=1.702, limit=1.5),
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, TorchOps().clamped_swiglu(x, alpha=1.702, limit=50.0))


@pytest.mark.cuda
def test_bf16_ops_match_torch_at_real_shapes():
    ops, ref = TritonOps(), TorchOps()
    x = randn(256, 4096).bfloat16()
    r = randn(256, 4096, seed=1).bfloat16()
    w = randn(4096, seed=2).bfloat16()
    for got, want in zip(ops.add_rms_norm(x, r, w, 1e-5), ref.add_rms_norm(x, r, w, 1e-5)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    gu = randn(256, 2 * 14336).bfloat16()
    torch.testing.assert_close(ops.silu_mul(gu), ref.silu_mul(gu), rtol=2e-2, atol=2e-2)
    # RoPE into an fp8 cache, on the GPU's own rounding. Keys are rotated in float32 and
    # rounded to bf16 once (within half a bf16 step of the exact rotation; the torch
    # path rounds each product to bf16, so where the two terms cancel the paths differ
    # by more than an fp8 step of the result), then each written key and value is
    # exactly its bf16 value rounded to fp8 as torch rounds it.
    hq, hkv, d = 32, 8, 128
    qkv = (randn(256, (hq + 2 * hkv) * d) * 64).bfloat16()
    freqs = torch.arange(256, device=DEVICE).float().unsqueeze(1) * (
        5e5 ** (-torch.arange(0, d, 2, device=DEVICE) / d))
    cos, sin = freqs.cos().bfloat16(), freqs.sin().bfloat16()
    slots = torch.randperm(1024, device=DEVICE)[:256]
    cache = torch.zeros(2, 64, 16, hkv, d, device=DEVICE, dtype=FP8)
    _, k, v = ops.rope_write_kv(qkv.clone(), cos, sin, hq, hkv, d, cache, slots)
    _, k_in, v_in = split_qkv(qkv, hq, hkv, d)
    # and with Qwen3's q and k norms: as the torch path's, within bf16 rounding
    norms = (randn(d, seed=3).bfloat16(), randn(d, seed=4).bfloat16(), 1e-6)
    for got, want in zip(ops.rope_write_kv(qkv.clone(), cos, sin, hq, hkv, d, cache.clone(),
                                           slots, norms),
                         ref.rope_write_kv(qkv.clone(), cos, sin, hq, hkv, d, cache.clone(),
                                           slots, norms)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    exact = apply_rotary(k_in.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1))
    torch.testing.assert_close(k.double(), exact, rtol=2 ** -8, atol=1e-4)
    assert torch.equal(v, v_in)
    for got, want in zip(slot_contents(cache, slots), (k, v)):
        assert torch.equal(got.view(torch.uint8), to_cache_dtype(want, FP8).view(torch.uint8))

