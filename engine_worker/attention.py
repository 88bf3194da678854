"""Attention over the paged KV cache.

Model of the algorithm: every token computed in a step has a *slot* in the cache
(block_id * block_size + offset). Each layer first writes the step's new keys and
values into their slots, then every query attends to its sequence's keys by reading
them back through the sequence's block table. Because all writes of a layer happen
before any read, a request may attend to blocks another request of the same step is
filling (in-batch prefix dedup).

The step's tokens are laid out flat: first the single-token queries (decodes, and
prefills that had all but their last token cached), one per sequence, then the
multi-token chunks one after another. Single-token queries run as one padded batch;
each multi-token chunk runs on its own. The metadata is built once per step by the
model runner and passed explicitly to every layer.

This module is the seam for device kernels. Single-token queries on the CPU go to a
C kernel that reads keys and values in place through the block tables
(engine_worker/kernels.py); everywhere else, and as the fallback, the sequence's
blocks are gathered and SDPA runs on them, which works on any device. A paged CUDA
kernel plugs in beside the CPU one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from engine_worker.kernels import CpuKernels


@dataclass(frozen=True)
class ChunkMetadata:
    """One multi-token query chunk of one sequence."""

    query_start: int  # offset of the chunk's first token in the flat batch
    query_len: int
    # The sequence's tokens in the cache once this chunk is written (prefix + chunk).
    context_len: int
    # (num_blocks,) the sequence's blocks covering context_len tokens.
    block_ids: torch.Tensor
    # (query_len, context_len) bool, True where a query may attend; None when the
    # chunk has no cached prefix (plain causal attention over the chunk itself).
    mask: Optional[torch.Tensor]


@dataclass(frozen=True)
class AttentionMetadata:
    # (num_tokens,) int64: cache slot of every token's key/value.
    slot_mapping: torch.Tensor
    # Leading tokens that are single-token queries, one per sequence.
    num_single: int
    # (num_single, max_blocks) int64 block tables, padded with block 0.
    single_block_tables: Optional[torch.Tensor]
    # (num_single,) int64: each single-token query's context length (itself included).
    single_context_lens: Optional[torch.Tensor]
    # (num_single, 1, 1, max_blocks * block_size) bool: key position within context.
    # Built only for the gather path (PagedAttention.needs_mask).
    single_mask: Optional[torch.Tensor]
    chunks: list[ChunkMetadata]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    """One layer's cache: keys and values, (2, num_blocks, block_size, H_kv, D)."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class PagedAttention:
    """One instance serves every layer (they share head counts and scale)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kernels: Optional[CpuKernels] = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads
        self.kernels = kernels

    @property
    def needs_mask(self) -> bool:
        """Whether single-token queries run on the gather path, which needs a mask."""
        return self.kernels is None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write k and v into the cache, then attend. q (N, Hq, D), k and v (N, Hkv, D)
        -> (N, Hq * D)."""
        h_kv, d = self.num_kv_heads, self.head_dim
        kv_cache[0].view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].view(-1, h_kv, d).index_copy_(0, meta.slot_mapping, v)
        return self.attend(q, k, v, kv_cache, meta)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention for keys and values already in the cache (k and v are the step's
        own, used directly by chunks without a cached prefix)."""
        n, d = q.shape[0], self.head_dim
        out = q.new_empty(n, self.num_heads, d)
        if meta.num_single:
            out[:meta.num_single] = self._single(q[:meta.num_single], kv_cache, meta)
        for chunk in meta.chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._chunk(q[rows], k[rows], v[rows], kv_cache, chunk)
        return out.view(n, self.num_heads * d)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """(2, num_blocks, bs, Hkv, D) cache, (...) ids -> (2, ..., bs, Hkv, D)."""
        flat = block_ids.reshape(-1)
        gathered = torch.index_select(kv_cache, 1, flat)
        return gathered.view(2, *block_ids.shape, *kv_cache.shape[2:])

    def _single(self, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        assert meta.single_block_tables is not None
        if self.kernels is not None:
            assert meta.single_context_lens is not None
            return self.kernels.paged_decode_attention(
                q, kv_cache, meta.single_block_tables, meta.single_context_lens, self.scale)
        assert meta.single_mask is not None
        b = q.shape[0]
        kv = self._gather(kv_cache, meta.single_block_tables)  # (2, B, nb, bs, Hkv, D)
        kv = kv.view(2, b, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=meta.single_mask,
            scale=self.scale, enable_gqa=self.gqa)  # (B, Hq, 1, D)
        return out.squeeze(2)

    def _chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, chunk: ChunkMetadata) -> torch.Tensor:
        if chunk.mask is None:
            # No cached prefix: attend within the chunk, causally.
            keys, values, mask, causal = k, v, None, True
        else:
            kv = self._gather(kv_cache, chunk.block_ids)  # (2, nb, bs, Hkv, D)
            kv = kv.view(2, -1, self.num_kv_heads, self.head_dim)[:, :chunk.context_len]
            keys, values, mask, causal = kv[0], kv[1], chunk.mask, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.gqa)  # (Hq, L, D)
        return out.transpose(0, 1)
