"""Paged attention in Triton: every sequence of a step, read in place from the cache.

Model. The step's query tokens are laid out flat (N, Hq, D): first the decode rows
(one query token per sequence), then the prompt chunks, one after another. Every
sequence s has a row in the block table, a context length ``seq_lens[s]`` (its tokens
in the cache once this step's keys are written, the new ones included) and a range of
query tokens ``query_start[s]:query_start[s + 1]``. The keys and values of this step
are already in the cache (rope_write_kv writes them before attention), so every query
reads only the cache: a chunk with a cached prefix and one without are the same case,
and a query at position p attends to keys 0..p (causal with an offset), or with a
sliding window W (a compile-time constant: one variant a window) to keys p - W + 1..p,
the loops starting at the block of the first key any row of the program sees.

Two kernels:
  * decode rows (_decode_kernel): a program per (sequence, KV head, split). It holds
    the query heads of the KV head's group, so each K/V block is loaded once for all
    of them (GQA), and computes transposed: the keys (then the head's dimensions) are
    the matrix products' rows and the group's heads their columns, which tl.dot pads
    to 8 where rows pad to 16. When the batch is too small to fill the GPU, a long
    context is split over several programs, each of which leaves its unnormalized
    partial result, maximum and sum; a second kernel merges them (flash-decoding).
  * chunks (_chunk_kernel): a program per (tile of BLOCK_Q query tokens of one chunk,
    KV head). Its rows are the tile's tokens times the group's heads.
The inner loop is online softmax over BLOCK_N keys at a time; key j of sequence s lives
at ``block_tables[s, j // page] * page + j % page``, so no block is copied out.

Padded decode rows (CUDA graphs run a fixed batch) have seq_lens 0: they read no key
and write zeros. A prompt step's graph runs a fixed number of chunk tiles too: its
padding tiles start past their chunk's end, so they read no key and write nothing.
The kernels compute in float32 and store in the queries' dtype; a cache of fp8 (float8
e4m3) is widened to float16 as it is read, and its dots run in float16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from engine_worker.attention import AttentionBackend, AttentionMetadata
from engine_worker.ops import FP8, value_blocks

MAX_SPLITS = 16


@dataclass(frozen=True)
class Tiling:
    block_n: int  # keys per inner-loop iteration
    num_warps: int
    num_stages: int = 3  # K/V tiles in flight (Triton's software pipelining; its default)
    rows: int = 0  # query rows per chunk program (query tokens times the group's heads)


def tiling(head_dim: int, decode: bool, fp8: bool = False) -> Tiling:
    """The tiles a launch compiles with. At head_dim 128, the fastest of
    benchmarks/gpu_attention.py's candidates (docs/performance.md): decode rows 64 keys
    on 4 warps (97% of copy bandwidth at batch 256 on an H100, 87% at 64; 8 warps gave
    93% and 76%), chunks 128 rows of 32 keys on 8 warps (1.7x 64 rows). An fp8 cache
    (H200, ``--kv-cache-dtype fp8``, values laid out along the keys): decode 64 keys
    on 2 warps with 2 tiles in flight (1.29x 4 warps at batch 256, 1.10x at 64), chunks
    128 rows of 64 keys on 8 warps (1.10x 64 rows on 4 warps). (The decode figures of
    a bfloat16 cache are the row form's, which the transposed one matched on an H200
    under Triton 3.6; Triton 3.9 gives it twice the shared memory, 67 KiB: to be timed.)
    ``python -m engine_worker.gpu.compile_check`` prints each variant's registers, and
    tests/gpu/test_compile.py fails on a spill (128 rows of 64 keys on 4 warps spill;
    at head_dim 256, Gemma 3's, an fp8 cache's 128 chunk rows spill, 64 do not)."""
    if head_dim <= 64:
        return Tiling(64, 4, rows=64)
    if fp8:
        return Tiling(64, 2, 2) if decode else Tiling(64, 8, rows=128 if head_dim <= 128 else 64)
    return Tiling(64, 4) if decode else Tiling(32, 8, rows=128)


def decode_heads(group: int) -> int:
    """Columns of a decode program's products: the group's query heads, padded to a
    power of two and to tl.dot's least, 8."""
    return max(8, triton.next_power_of_2(group))


def tilings(head_dim: int, fp8: bool = False) -> tuple[Tiling, Tiling]:
    """(decode, chunk) tilings of a cache of fp8 or of the queries' dtype."""
    return tiling(head_dim, True, fp8), tiling(head_dim, False, fp8)


@triton.jit
def _fp8_values(v_ptr, table_ptr, start, hi, kv_head, stride_block,
                BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Values of keys start..start + BLOCK_N as (BLOCK_N, D_PAD), or (D_PAD, BLOCK_N)
    if TRANSPOSED, from an fp8 cache, whose blocks hold them (Hkv, D, PAGE). Read whole
    pages, unmasked (every address is in the cache), so that each row of PAGE bytes is
    one contiguous load and the tile reaches the tensor cores laid out along the keys.
    (Where a block is larger than the tile, the tile's span of it.) What lies past the
    context is left as it is: those keys' probabilities are 0, and an fp8 cache holds
    no NaN (its writes make one 0, engine_worker.ops.to_cache_dtype; its blocks start
    zeroed), so their products are 0. Masking it made the decode loop half as long
    again or more: 1,820 instructions a pass of 128 keys for 963 (sm_90, Triton 3.9;
    3.6: 1,585 for 1,061), the select after the widening taking byte permutes with it.
    (The chunks' (BLOCK_N, D_PAD) tile is loaded as such: transposing the other took
    9% more instructions a pass under Triton 3.6.)"""
    PAGES: tl.constexpr = BLOCK_N // PAGE if BLOCK_N >= PAGE else 1
    SPAN: tl.constexpr = PAGE if BLOCK_N >= PAGE else BLOCK_N
    first = start + tl.arange(0, PAGES) * SPAN  # each page's first key in the tile
    page = tl.load(table_ptr + first // PAGE, mask=first < hi, other=0)
    d = tl.minimum(tl.arange(0, D_PAD), HEAD_DIM - 1)  # in the head, even where padded
    span = tl.arange(0, SPAN)
    head = kv_head * (HEAD_DIM * PAGE)
    if TRANSPOSED:  # (D_PAD, PAGES, SPAN)
        at = (page.to(tl.int64)[None, :, None] * stride_block + head + d[:, None, None] * PAGE
              + (first % PAGE)[None, :, None] + span[None, None, :])
        tile = tl.reshape(tl.load(v_ptr + at), (D_PAD, BLOCK_N))
    else:  # (PAGES, D_PAD, SPAN)
        at = (page.to(tl.int64)[:, None, None] * stride_block + head + d[None, :, None] * PAGE
              + (first % PAGE)[:, None, None] + span[None, None, :])
        tile = tl.reshape(tl.permute(tl.load(v_ptr + at), (0, 2, 1)), (BLOCK_N, D_PAD))
    return tile


@triton.jit
def _online_softmax(s, m, denom, AXIS: tl.constexpr):
    """One tile's scores s into the running maximum m and denominator of each query
    (reduced along AXIS, the keys): (p, m_new, alpha, denom_new), alpha rescaling what
    the earlier tiles added up."""
    m_new = tl.maximum(m, tl.max(s, AXIS))
    # A query that has seen no allowed key keeps m = -inf; shift by 0 there, not by
    # -inf (which would give NaN).
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - tl.expand_dims(shift, AXIS))
    alpha = tl.exp(m - shift)
    return p, m_new, alpha, denom * alpha + tl.sum(p, AXIS)


@triton.jit
def _key_rows(table_ptr, start, hi, kv_head, stride_kb, stride_ks, stride_kh,
              BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Keys start..start + BLOCK_N of a sequence (table_ptr: its block table row):
    (their rows' offsets in the cache, which of them are below hi)."""
    k_pos = start + tl.arange(0, BLOCK_N)
    k_ok = k_pos < hi
    page = tl.load(table_ptr + k_pos // PAGE, mask=k_ok, other=0)
    return page.to(tl.int64) * stride_kb + (k_pos % PAGE) * stride_ks + kv_head * stride_kh, k_ok


@triton.jit
def _for_dots(q, k_ptr):
    """The queries in the dots' dtype: theirs, or for an fp8 cache float16, which holds
    e4m3 exactly and widens it in one instruction a pair (bfloat16 takes three), the
    queries held within its range."""
    if k_ptr.dtype.element_ty.is_fp8():
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _soft_cap(s, CAP: tl.constexpr):
    """Gemma 2's scores: CAP tanh(s / CAP) (tanh x = 1 - 2 / (e^2x + 1)); s as it is
    where CAP is 0."""
    if CAP > 0:
        s = CAP * (1.0 - 2.0 / (tl.exp(s * (2.0 / CAP)) + 1.0))
    return s


@triton.jit
def _join_sink(m, denom, sinks_ptr, head, ok):
    """A head's sink logit (gpt-oss) joined to the online softmax's state (the maximum
    m and the denominator): what the accumulated values are to be multiplied by, and
    the new denominator."""
    sink = tl.load(sinks_ptr + head, mask=ok, other=0.0).to(tl.float32)
    top = tl.maximum(m, sink)
    keep = tl.exp(m - top)
    return keep, denom * keep + tl.exp(sink - top)


@triton.jit
def _decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        block_tables_ptr, seq_lens_ptr, sinks_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_bt,
        GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        SPLITS: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr = 0.0, SINKS: tl.constexpr = False):
    """Decode row ``seq`` (one query token), KV head, split of its context; computed
    transposed: the scores s^T = K q^T are (BLOCK_N, HEADS) and the output acc^T = V^T
    p^T (D_PAD, HEADS), HEADS the group's query heads padded to 8 where rows pad to 16.
    (The row form took 1.8 times the instructions a key on an fp8 cache, its warps'
    together, and 1.29x the time at batch 256 on an H200; as fast on a bfloat16 one;
    docs/performance.md.)"""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)  # (the engine's are int64)
    cols = tl.arange(0, HEADS)
    head = kv_head * GROUP + cols
    col_ok = cols < GROUP  # (a padded row, context 0, reads no key and writes zeros)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    qt = _for_dots(tl.load(q_ptr + seq * stride_qt + head[None, :] * stride_qh + d[:, None],
                           mask=d_ok[:, None] & col_ok[None, :], other=0.0), k_ptr)

    # the window's first key (0 without one); the splits share the keys from its tile on
    low = tl.where(WINDOW > 0, tl.maximum(ctx - WINDOW, 0), 0)
    first = low // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(ctx - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, ctx)
    table = block_tables_ptr + seq * stride_bt
    m = tl.full([HEADS], float("-inf"), tl.float32)
    denom = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([D_PAD, HEADS], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        base, k_ok = _key_rows(table, start, hi, kv_head, stride_kb, stride_ks, stride_kh,
                               BLOCK_N, PAGE)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        # An fp8 cache's keys and values are widened to the dots' dtype (the queries').
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(qt.dtype)
        s = _soft_cap(tl.dot(k, qt, input_precision=PRECISION) * scale, SOFTCAP)
        if WINDOW > 0:
            k_ok = k_ok & (start + tl.arange(0, BLOCK_N) >= low)
        s = tl.where(k_ok[:, None], s, float("-inf"))
        p, m, alpha, denom = _online_softmax(s, m, denom, 0)
        if k_ptr.dtype.element_ty.is_fp8():
            vt = _fp8_values(v_ptr, table, start, hi, kv_head, stride_kb, BLOCK_N, PAGE,
                             HEAD_DIM, D_PAD, True)
        else:
            vt = tl.trans(tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0))
        acc = acc * alpha[None, :] + tl.dot(vt.to(qt.dtype), p.to(qt.dtype),
                                            input_precision=PRECISION)

    ok = cols < GROUP
    if SPLITS == 1:
        if SINKS:   # (split rows take theirs where the splits merge)
            keep, denom = _join_sink(m, denom, sinks_ptr, head, ok)
            acc = acc * keep[None, :]
        out = acc / tl.where(denom > 0, denom, 1.0)[None, :]
        tl.store(out_ptr + seq * stride_ot + head[None, :] * stride_oh + d[:, None],
                 out.to(out_ptr.dtype.element_ty), mask=d_ok[:, None] & ok[None, :])
    else:
        # Partials of decode row `seq`: acc (B, Hq, SPLITS, D_PAD); the maximum and the
        # softmax denominator (B, Hq, SPLITS, 2).
        cell = (seq * (GROUP * tl.num_programs(1)) + head) * SPLITS + split
        tl.store(part_acc_ptr + cell[None, :] * D_PAD + d[:, None], acc, mask=ok[None, :])
        tl.store(part_ml_ptr + cell * 2, m, mask=ok)
        tl.store(part_ml_ptr + cell * 2 + 1, denom, mask=ok)


@triton.jit
def _chunk_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        tile_seq_ptr, tile_offset_ptr, sinks_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr = 0.0, SINKS: tl.constexpr = False):
    """Query tokens q_off..q_off + BLOCK_Q of the chunk of sequence ``seq`` (tile
    ``tile``), KV head; rows (token, head in the group), causal."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_off = tl.load(tile_offset_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_off + rows // GROUP_PAD  # query token within the sequence's chunk
    in_group = rows % GROUP_PAD
    head = kv_head * GROUP + in_group
    row_ok = (tok < q_len) & (in_group < GROUP)
    q_pos = ctx - q_len + tok  # the query's position in its sequence
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = _for_dots(tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt
                          + head[:, None] * stride_qh + d[None, :],
                          mask=row_ok[:, None] & d_ok[None, :], other=0.0), k_ptr)

    # Keys this tile may see: up to its last query's position (causal). A padding tile
    # (a CUDA graph's fixed grid: its first query past the chunk's end) reads no key.
    last_tok = tl.minimum(q_off + BLOCK_Q, q_len) - 1
    hi = tl.where(q_off < q_len, tl.maximum(ctx - q_len + last_tok + 1, 0), 0)
    # and from its first query's window on
    low = tl.where(WINDOW > 0, tl.maximum(ctx - q_len + q_off - WINDOW + 1, 0), 0)
    table = block_tables_ptr + seq * stride_bt
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)
    for start in range(low // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        base, k_ok = _key_rows(table, start, hi, kv_head, stride_kb, stride_ks, stride_kh,
                               BLOCK_N, PAGE)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = _soft_cap(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, SOFTCAP)
        causal = start + tl.arange(0, BLOCK_N)[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            causal = causal & (start + tl.arange(0, BLOCK_N)[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(k_ok[None, :] & causal, s, float("-inf"))
        p, m, alpha, denom = _online_softmax(s, m, denom, 1)
        if k_ptr.dtype.element_ty.is_fp8():
            v = _fp8_values(v_ptr, table, start, hi, kv_head, stride_kb, BLOCK_N, PAGE,
                            HEAD_DIM, D_PAD, False)
        else:
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=PRECISION)

    if SINKS:
        keep, denom = _join_sink(m, denom, sinks_ptr, head, in_group < GROUP)
        acc = acc * keep[:, None]
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, sinks_ptr, stride_ot, stride_oh,
                         SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         SINKS: tl.constexpr = False):
    """One program per (decode row, query head): the splits' partials, rescaled to a
    common maximum, summed and normalized (with the head's sink logit in the
    denominator, where it has one)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    cell = (row * tl.num_programs(1) + head) * SPLITS
    s = tl.arange(0, SPLITS)
    m = tl.load(part_ml_ptr + (cell + s) * 2)
    denom = tl.load(part_ml_ptr + (cell + s) * 2 + 1)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    weight = tl.where(m == float("-inf"), 0.0,
                      tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max)))
    total = tl.sum(denom * weight, 0)
    if SINKS:
        total += tl.exp(sink - m_max)
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + (cell + s)[:, None] * D_PAD + d[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def chunk_block_q(group: int, tiles: Tiling) -> int:
    """Query tokens per chunk program: the chunk tiling's rows of (token, head in group)."""
    return max(1, tiles.rows // triton.next_power_of_2(group))


def chunk_tiles(query_lens: Sequence[int], first_seq: int, block_q: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The chunk programs of sequences first_seq, first_seq + 1, ... with these query
    lengths: (sequence, first query token) of every tile of block_q tokens."""
    lens = np.asarray(query_lens, dtype=np.int64)
    counts = -(-lens // block_q)
    seqs = np.repeat(np.arange(first_seq, first_seq + len(lens)), counts)
    starts = np.cumsum(counts) - counts
    offsets = (np.arange(counts.sum()) - np.repeat(starts, counts)) * block_q
    return seqs.astype(np.int32), offsets.astype(np.int32)


def num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits of each decode row's context: enough programs to fill the GPU twice over
    when the batch alone does not (a power of two, at most MAX_SPLITS)."""
    programs = max(1, batch * num_kv_heads)
    splits = 1
    while splits < MAX_SPLITS and programs * splits < 2 * num_sms:
        splits *= 2
    return splits


@dataclass
class SplitBuffers:
    """Scratch for split decode rows, allocated once for the largest batch."""

    acc: torch.Tensor  # (B, Hq, MAX_SPLITS, D_PAD) float32
    ml: torch.Tensor  # (B, Hq, MAX_SPLITS, 2) float32

    @classmethod
    def allocate(cls, max_rows: int, num_heads: int, head_dim: int,
                 device: torch.device) -> "SplitBuffers":
        d_pad = triton.next_power_of_2(head_dim)
        return cls(torch.empty(max_rows * num_heads * MAX_SPLITS * d_pad, dtype=torch.float32,
                               device=device),
                   torch.empty(max_rows * num_heads * MAX_SPLITS * 2, dtype=torch.float32,
                               device=device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, num_decode: int,
                    tile_seq: Optional[torch.Tensor], tile_offset: Optional[torch.Tensor],
                    scale: float, splits: int = 1,
                    split_buffers: Optional[SplitBuffers] = None,
                    tiles: Optional[tuple[Tiling, Tiling]] = None, window: int = 0,
                    softcap: float = 0.0, sinks: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
    """Attention of every query in ``q`` (N, Hq, D) over the paged cache (k_cache
    (num_blocks, page, Hkv, D), v_cache as engine_worker.ops.value_blocks lays it out:
    so too, or for fp8 (num_blocks, Hkv, D, page)) into ``out`` (N, Hq, D).

    Sequences 0..num_decode-1 are decode rows (query token i is sequence i); the
    chunk tiles are (tile_seq[t], tile_offset[t]): a sequence and its first query
    token of the tile, chunk_block_q(group, tiles[1]) tokens per tile. block_tables
    (S, W) int32; seq_lens (S,) and query_start (S + 1,) integers (query_start is read
    only for chunks). ``tiles``: the (decode, chunk) tilings; by default tilings()'s
    for the cache's dtype. ``window`` > 0: a sliding window of that many keys;
    ``softcap`` > 0: each score s made softcap tanh(s / softcap) (Gemma 2); ``sinks``
    (Hq,): each head's sink logit, in the softmax's denominator (gpt-oss)."""
    _, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    assert v_cache.is_contiguous() and v_cache.numel() == k_cache.numel()
    tiles = tiles or tilings(d, fp8=k_cache.dtype == FP8)
    group = hq // hkv
    d_pad = triton.next_power_of_2(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(GROUP=group, PAGE=page, HEAD_DIM=d, D_PAD=d_pad, PRECISION=precision,
                  WINDOW=window, SOFTCAP=float(softcap), SINKS=sinks is not None)
    sinks_ptr = q if sinks is None else sinks   # (not read without sinks)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    if num_decode:
        if splits > 1:
            assert split_buffers is not None and splits <= MAX_SPLITS
            acc, ml = split_buffers.acc, split_buffers.ml
        else:
            acc = ml = out  # not written
        t = tiles[0]
        _decode_kernel[(num_decode, hkv, splits)](
            q, k_cache, v_cache, out, acc, ml, block_tables, seq_lens, sinks_ptr, scale,
            *strides,
            HEADS=decode_heads(group), BLOCK_N=t.block_n,
            SPLITS=splits, num_warps=t.num_warps, num_stages=t.num_stages, **common)
        if splits > 1:
            _merge_splits_kernel[(num_decode, hq)](
                acc, ml, out, sinks_ptr, out.stride(0), out.stride(1), SPLITS=splits,
                HEAD_DIM=d, D_PAD=d_pad, SINKS=sinks is not None)
    if tile_seq is not None and tile_seq.numel():
        assert tile_offset is not None
        t = tiles[1]
        _chunk_kernel[(tile_seq.numel(), hkv)](
            q, k_cache, v_cache, out, block_tables, seq_lens, query_start, tile_seq,
            tile_offset, sinks_ptr, scale, *strides, GROUP_PAD=triton.next_power_of_2(group),
            BLOCK_Q=chunk_block_q(group, t), BLOCK_N=t.block_n, num_warps=t.num_warps,
            num_stages=t.num_stages, **common)
    return out


class TritonAttention(AttentionBackend):
    """The attention backend of the CUDA engine: paged_attention for every sequence of
    the step."""

    chunk_tiles = staticmethod(chunk_tiles)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 max_decode_rows: int, device: torch.device, fp8_cache: bool = False,
                 softcap: float = 0.0, num_sms: int = 1) -> None:
        """num_sms: the GPU's multiprocessors, which split decode rows fill."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale, softcap)
        self.split_buffers = SplitBuffers.allocate(max_decode_rows, num_heads, head_dim, device)
        self.tiles = tilings(head_dim, fp8_cache)
        self.num_sms = num_sms

    @property
    def tile_tokens(self) -> int:
        return chunk_block_q(self.num_heads // self.num_kv_heads, self.tiles[1])

    def decode_splits(self, num_decode: int) -> int:
        return num_splits(num_decode, self.num_kv_heads, self.num_sms)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q (N, Hq, D) -> (N, Hq * D); k and v are already in the cache."""
        n = q.shape[0]
        # A prompt graph's padded tokens past its last padded sequence are in no chunk
        # tile, so nothing writes their rows: zeros, not whatever the memory held, go
        # on through the layers (decode rows are written, padded or not)
        padded = meta.num_decode < n and meta.query_start_host[-1] < n
        out = (q.new_zeros if padded else q.new_empty)(n, self.num_heads, self.head_dim)
        paged_attention(q, kv_cache[0], value_blocks(kv_cache), out, meta.block_tables,
                        meta.seq_lens, meta.query_start, meta.num_decode, meta.tile_seq,
                        meta.tile_offset, self.scale, meta.num_splits, self.split_buffers,
                        self.tiles, window, self.softcap, sinks)
        return out.view(n, self.num_heads * self.head_dim)
