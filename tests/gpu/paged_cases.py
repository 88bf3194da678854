"""Random paged-attention inputs and a float64 reference written without the kernel's
tricks (no online softmax, no paging: each sequence's keys gathered, then plain
softmax attention with a causal offset)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from engine_worker.gpu.attention import chunk_block_q, chunk_tiles, tiling
from engine_worker.ops import from_value_blocks, to_value_blocks


@dataclass
class PagedCase:
    q: torch.Tensor  # (N, Hq, D)
    k_cache: torch.Tensor  # (num_blocks, page, Hkv, D)
    v_cache: torch.Tensor  # laid out as engine_worker.ops.value_blocks
    block_tables: torch.Tensor  # (S, W) int32, padded with stray block ids
    seq_lens: torch.Tensor  # (S,) int32
    query_start: torch.Tensor  # (S + 1,) int32
    num_decode: int
    tile_seq: torch.Tensor
    tile_offset: torch.Tensor
    scale: float


def make_case(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
              page: int = 16, dtype: torch.dtype = torch.float32, device: str = "cpu",
              extra_width: int = 2, seed: int = 0,
              cache_dtype: torch.dtype | None = None) -> PagedCase:
    """seqs: (context length, query tokens) per sequence, decode rows (1 query
    token) first. A context length of 0 is a padded row. Blocks are shuffled over
    the pool, and every table row is padded with ids of blocks other sequences use,
    so reading past a context shows. The cache is in cache_dtype (default: dtype)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-ctx // page) for ctx, _ in seqs]
    width = max(need) + extra_width
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(seqs), width), generator=gen, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    q_lens = [q for _, q in seqs]
    n_tokens = sum(q_lens)
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    v_cache = to_value_blocks(torch.randn(shape, generator=gen).to(cache_dtype or dtype))
    q = torch.randn(n_tokens, num_heads, head_dim, generator=gen).to(dtype)
    num_decode = 0
    while num_decode < len(seqs) and q_lens[num_decode] == 1:
        num_decode += 1
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    chunk = tiling(head_dim, decode=False, fp8=cache_dtype == torch.float8_e4m3fn)
    tile_seq, tile_offset = chunk_tiles(q_lens[num_decode:], num_decode,
                                        chunk_block_q(num_heads // num_kv_heads, chunk))
    to = dict(device=device)
    return PagedCase(q.to(**to), k_cache.to(**to), v_cache.to(**to), tables.to(**to),
                     torch.tensor([c for c, _ in seqs], dtype=torch.int32, **to),
                     torch.from_numpy(query_start).to(**to), num_decode,
                     torch.from_numpy(tile_seq).to(**to), torch.from_numpy(tile_offset).to(**to),
                     head_dim ** -0.5)


def reference(case: PagedCase, window: int = 0, softcap: float = 0.0,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, Hq, D) float64; padded rows (context 0) are zeros. window > 0: each query
    sees its last ``window`` keys only; softcap > 0: scores s are softcap tanh(s /
    softcap); sinks (Hq,): each head's sink logit joins every query's softmax."""
    q = case.q.double().cpu()
    k_cache = case.k_cache.double().cpu()
    v_cache = from_value_blocks(case.v_cache.cpu()).double()
    page = k_cache.shape[1]
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    starts = case.query_start.tolist()
    for s, ctx in enumerate(case.seq_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        if ctx == 0:
            continue
        blocks = case.block_tables[s].cpu().long()[:-(-ctx // page)]
        keys = k_cache[blocks].reshape(-1, hkv, k_cache.shape[-1])[:ctx]
        values = v_cache[blocks].reshape(-1, hkv, k_cache.shape[-1])[:ctx]
        keys = keys.repeat_interleave(hq // hkv, dim=1)  # (ctx, Hq, D)
        values = values.repeat_interleave(hq // hkv, dim=1)
        rows = q[starts[s]:starts[s + 1]]  # (L, Hq, D)
        scores = torch.einsum("lhd,khd->hlk", rows, keys) * case.scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
        key_pos = torch.arange(ctx).unsqueeze(0)
        hidden = key_pos > q_pos
        if window:
            hidden |= key_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[starts[s]:starts[s + 1]] = torch.einsum("hlk,khd->lhd", probs, values)
    return out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())
