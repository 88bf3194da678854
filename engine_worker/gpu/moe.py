"""A mixture of experts on the GPU: all of a layer's experts in one grouped GEMM launch
a projection, routed on the device, so a step with one takes no host sync and replays
from a CUDA graph like any other.

The step's rows (each token once for each of its k experts) are sorted by expert, and
each expert's run is padded to whole tiles of BLOCK_M rows. A program takes one tile
and one tile of output columns: it multiplies the tile's rows by its expert's weight
and writes each result row where the row came from. An expert overruns its rows by
under a tile, so the number of tiles is bounded by the step's token count alone (what
capture needs); the tiles past the last expert's exit at once. The experts' weights
lie stacked, (E, 2 I, C) for gate and up and (E, C, I) for down, as nn.Linear's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def _fp4(code):
    """FP4 (E2M1) codes 0-15 as float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6, and their
    negatives from 8 on; built as float32's bits (the sign, the code's exponent less
    its bias of 1 plus float32's of 127, its mantissa bit on top), 0.5 and 0 apart."""
    c = code.to(tl.int32)
    e, m = (c >> 1) & 3, c & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23)) | ((c >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, route_ptr,
                        bias_ptr, scale_ptr, num_rows, stride_a, stride_we, stride_wn,
                        stride_o, stride_se, stride_sn,
                        N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                        PER_TOKEN: tl.constexpr, WEIGHTED: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr = False, MXFP4: tl.constexpr = False,
                        FP8: tl.constexpr = False):
    """out[row] = a[row's input] @ w[expert].T (+ bias[expert], (E, N), with HAS_BIAS)
    for the BLOCK_M rows of this program's tile, BLOCK_N output columns. rows: the
    sorted rows, a row r being token r // TOP_K's (r % TOP_K)-th choice, num_rows where
    padding. PER_TOKEN: a holds a row per token (the layer's input) rather than per
    row; WEIGHTED: each result times its routing weight (route: float32 per row).
    MXFP4: w holds bytes (E, N, K / 2), input 2j in byte j's low nibble and 2j + 1 in
    its high one (gpt-oss's checkpoints' order), each run of 32 inputs scaled by
    2^(s - 127) for its byte s of scale (E, N, K / 32): the inputs' even and odd
    halves are multiplied apart, so no nibbles are interleaved. FP8: w holds float8
    e4m3 (E, N, K), widened to the activations' dtype as it is read (exact), each
    output column times its float32 scale (scale: (E, N)) once the sums are done."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:   # past the last expert's tiles
        return
    rows = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    src = rows // TOP_K if PER_TOKEN else rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * stride_a + ks[None, :]
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4:
        acc = _mxfp4_loop(a_ptr, w_ptr, scale_ptr, src, valid, cols, expert, acc, stride_a,
                          stride_we, stride_wn, stride_se, stride_sn, N, K, PRECISION,
                          BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            inside = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & inside[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(cols < N)[None, :] & inside[:, None], other=0.0)
            if FP8:
                w = w.to(a.dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if FP8:
            acc *= tl.load(scale_ptr + expert.to(tl.int64) * stride_se + cols * stride_sn,
                           mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * N + cols, mask=cols < N,
                       other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc = acc * tl.load(route_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols < N)[None, :])


@triton.jit
def _mxfp4_loop(a_ptr, w_ptr, scale_ptr, src, valid, cols, expert, acc, stride_a,
                stride_we, stride_wn, stride_se, stride_sn, N: tl.constexpr,
                K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop of an MXFP4 weight (_expert_gemm_kernel): BLOCK_K inputs a pass,
    BLOCK_K / 2 bytes of each output column, decoded to the activations' dtype (exact:
    FP4 values times powers of two)."""
    kb = tl.arange(0, BLOCK_K // 2)
    col_ok = (cols < N)[None, :]
    a_rows = a_ptr + src.to(tl.int64)[:, None] * stride_a
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    s_cols = scale_ptr + expert.to(tl.int64) * stride_se + cols.to(tl.int64)[None, :] * stride_sn
    for k0 in range(0, K, BLOCK_K):
        byte = k0 // 2 + kb   # (K is whole blocks of 32: every byte inside or none)
        inside = byte < K // 2
        packed = tl.load(w_cols + byte[:, None], mask=col_ok & inside[:, None], other=0)
        scale = tl.load(s_cols + (byte // 16)[:, None], mask=col_ok & inside[:, None],
                        other=127)
        mult = tl.exp2(scale.to(tl.float32) - 127.0)
        even = tl.load(a_rows + 2 * byte[None, :], mask=valid[:, None] & inside[None, :],
                       other=0.0)
        odd = tl.load(a_rows + 2 * byte[None, :] + 1, mask=valid[:, None] & inside[None, :],
                      other=0.0)
        low = (_fp4(packed & 15) * mult).to(even.dtype)
        high = (_fp4(packed >> 4) * mult).to(even.dtype)
        acc = tl.dot(even, low, acc, input_precision=PRECISION)
        acc = tl.dot(odd, high, acc, input_precision=PRECISION)
    return acc


@dataclass(frozen=True)
class ExpertTiling:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def expert_tiling(tokens: int, num_experts: int) -> ExpertTiling:
    """Tiles of 16 rows where experts get few rows each (decode: at 64 tokens of 8
    choices among 128 experts, 4 rows an expert), of 64 where many (prompt chunks)."""
    if tokens <= num_experts:
        return ExpertTiling(16, 64, 64, num_warps=4, num_stages=4)
    return ExpertTiling(64, 64, 64, num_warps=4, num_stages=3)


def sort_rows(chosen: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """chosen (N, k): each token's experts -> (rows, tile_expert). rows (tiles x
    block_m,): the N k rows grouped by expert (in row order within an expert), each
    expert's run padded to whole tiles with N k; tile_expert (tiles,): each tile's
    expert, -1 past the last. tiles = ceil(N k / block_m) + min(N k, experts), the
    most padding can take: every size is known before the routing is, and nothing here
    waits for the device."""
    flat = chosen.flatten()
    t, device = flat.numel(), flat.device
    tiles = triton.cdiv(t, block_m) + min(t, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    # a row's place: its expert's first padded slot, plus its rank among that expert's
    at = (ends - padded)[expert] + torch.arange(t, device=device) - (counts.cumsum(0)
                                                                      - counts)[expert]
    rows = torch.full((tiles * block_m,), t, dtype=torch.int32, device=device)
    rows.scatter_(0, at, order.to(torch.int32))
    starts = torch.arange(tiles, device=device) * block_m
    tile_expert = torch.searchsorted(ends, starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return rows, tile_expert


def expert_gemm(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor,
                tile_expert: torch.Tensor, tiles: ExpertTiling, top_k: int,
                route: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One projection of every expert: (T, out) for the T = N k rows, from a (N, in)
    (a row per token) or (T, in) (a row per row, ``route``-weighted); ``bias`` (E,
    out): each expert's, added before the weighting. With ``scales`` (E, out, in /
    32) uint8, w is MXFP4 bytes (E, out, in / 2); with (E, out) float32, w is fp8 (E,
    out, in), a scale per output channel (_expert_gemm_kernel)."""
    experts, n_out, k_in = w.shape
    fp8 = w.dtype == torch.float8_e4m3fn
    if fp8:
        assert scales is not None and scales.shape == (experts, n_out)
    elif scales is not None:
        k_in *= 2
        assert w.dtype == torch.uint8 and scales.shape == (experts, n_out, k_in // 32)
    per_token = route is None
    t = a.shape[0] * top_k if per_token else a.shape[0]
    assert a.stride(1) == 1 and w.is_contiguous()
    assert bias is None or (bias.is_contiguous() and bias.shape == (experts, n_out))
    out = a.new_empty(t, n_out)
    if t:
        grid = (tile_expert.shape[0], triton.cdiv(n_out, tiles.block_n))
        _expert_gemm_kernel[grid](
            a, w, out, rows, tile_expert, a if route is None else route,
            a if bias is None else bias, w if scales is None else scales, t,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            *((0, 0) if scales is None else (scales.stride(0), scales.stride(1))),
            N=n_out, K=k_in, TOP_K=top_k, PER_TOKEN=per_token, WEIGHTED=not per_token,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            HAS_BIAS=bias is not None, MXFP4=scales is not None and not fp8, FP8=fp8,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


class GroupedExperts(nn.Module):
    """A mixture's experts, their weights (and biases, gpt-oss's) stacked, taken from
    its per-expert MLPs, which it replaces (fp8 ones with their row scales); or
    (``mxfp4``) made empty for a checkpoint's MXFP4 experts, kept so."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        self.act: Callable[[torch.Tensor], torch.Tensor] = experts[0].act

        def stacked(tensors: list[Optional[torch.Tensor]]) -> Optional[nn.Parameter]:
            if tensors[0] is None:
                return None
            return nn.Parameter(torch.stack(tensors), requires_grad=False)

        fp8 = experts[0].gate_up_proj.weight.dtype == torch.float8_e4m3fn
        self.gate_up = stacked([e.gate_up_proj.weight for e in experts])
        self.down = stacked([e.down_proj.weight for e in experts])
        # (E, out) float32 for fp8 weights; None for dense ones
        self.gate_up_scales = stacked([e.gate_up_proj.weight_scale for e in experts]
                                      if fp8 else [None])
        self.down_scales = stacked([e.down_proj.weight_scale for e in experts]
                                   if fp8 else [None])
        self.gate_up_bias = stacked([e.gate_up_proj.bias for e in experts])
        self.down_bias = stacked([e.down_proj.bias for e in experts])

    @classmethod
    def mxfp4(cls, num_experts: int, hidden: int, intermediate: int,
              act: Callable[[torch.Tensor], torch.Tensor], bias: bool) -> "GroupedExperts":
        """Experts whose weights stay MXFP4 (gpt-oss's checkpoints): bytes gate_up (E,
        2 I, C / 2) and down (E, C, I / 2), scales a byte a 32 inputs; made empty (the
        loader fills them), on the current device."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.act = act

        def empty(*shape: int, dtype=torch.uint8) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        e, c, i = num_experts, hidden, intermediate
        module.gate_up, module.gate_up_scales = empty(e, 2 * i, c // 2), empty(e, 2 * i, c // 32)
        module.down, module.down_scales = empty(e, c, i // 2), empty(e, c, i // 32)
        module.gate_up_bias = empty(e, 2 * i, dtype=torch.float32) if bias else None
        module.down_bias = empty(e, c, dtype=torch.float32) if bias else None
        return module

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                ) -> torch.Tensor:
        """x (N, C); weights, chosen (N, k): each token's routing -> (N, C), the sum of
        its k experts' outputs, each times its weight."""
        n, c = x.shape
        top_k = chosen.shape[1]
        tiles = expert_tiling(n, self.gate_up.shape[0])
        rows, tile_expert = sort_rows(chosen, self.gate_up.shape[0], tiles.block_m)
        h = self.act(expert_gemm(x, self.gate_up, rows, tile_expert, tiles, top_k,
                                 bias=self.gate_up_bias, scales=self.gate_up_scales))
        y = expert_gemm(h, self.down, rows, tile_expert, tiles, top_k,
                        route=weights.float().flatten(), bias=self.down_bias,
                        scales=self.down_scales)
        return y.view(n, top_k, c).sum(1)
