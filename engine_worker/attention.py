"""Attention over the paged KV cache, behind one small interface.

Model of the algorithm: every token computed in a step has a *slot* in the cache
(block_id * block_size + offset). Each layer first writes the step's new keys and
values into their slots, then every query attends to its sequence's keys by reading
them back through the sequence's block table. Because all writes of a layer happen
before any read, a request may attend to blocks another request of the same step is
filling (in-batch prefix dedup).

The step's tokens are laid out flat: first the single-token queries (decodes, and
prefills that had all but their last token cached), one per sequence, then the
multi-token chunks one after another (step_inputs.step_layout). The metadata is built
once per step (step_inputs.StepInputs) and passed explicitly to every layer.

Backends, chosen once at start by the platform (platform.py):
  * ``TorchAttention``: the reference, on any device. A sequence's blocks are gathered
    and SDPA runs on them.
  * ``CpuAttention`` (engine_worker/cpu/attention.py): single-token queries through the
    C kernel that reads keys and values in place; chunks as the reference.
  * ``TritonAttention`` (engine_worker/gpu/attention.py): one kernel family for every
    sequence of the step, reading the cache in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from engine_worker.ops import FP8, from_value_blocks, soft_cap, value_blocks, write_kv


@dataclass
class AttentionMetadata:
    # (T,) int64: cache slot of every token's key/value; -1 for a padded row.
    slot_mapping: torch.Tensor
    # Leading sequences that are single-token queries (sequence i is token i).
    num_decode: int
    # (S, W) int32: each sequence's block ids; entries past its context are stale.
    block_tables: torch.Tensor
    # (S,) int64: each sequence's tokens in the cache once this step's are written.
    seq_lens: torch.Tensor
    # (S + 1,) int64: sequence s's query tokens are query_start[s]:query_start[s + 1].
    query_start: torch.Tensor
    # (num_tiles,) int64: the Triton kernel's chunk programs (sequence, first query).
    tile_seq: torch.Tensor
    tile_offset: torch.Tensor
    # Programs each decode row's context is split over (Triton).
    num_splits: int
    # The same as host lists, for the reference path, for the unpadded sequences.
    seq_lens_host: list[int]
    query_start_host: list[int]
    # The sliding-window layers' own view where they have a pool of their own
    # (window_blocks.py): the same but for its block tables and slots.
    local: Optional["AttentionMetadata"] = None

    @functools.cached_property
    def decode_tables_int64(self) -> torch.Tensor:
        """(num_decode, W) int64 block tables (the C kernel's index type)."""
        return self.block_tables[:self.num_decode].long()

    @functools.cached_property
    def decode_lens_int64(self) -> torch.Tensor:
        return self.seq_lens[:self.num_decode]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    """One layer's cache: keys and values, (2, num_blocks, block_size, H_kv, D) (an fp8
    cache's values lie otherwise within each block: engine_worker.ops.value_blocks)."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class AttentionBackend:
    """The interface every backend implements. One instance serves every layer (they
    share head counts and scale)."""

    # Query tokens per chunk tile of the backend's kernel, and how it tiles a step's
    # chunks ((chunk lengths, first sequence, tile_tokens) -> each tile's sequence and
    # first query token); 1 and None: it takes no tiles (step_inputs.py)
    tile_tokens = 1
    chunk_tiles: Optional[Callable] = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 softcap: float = 0.0) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # > 0: each score s becomes softcap tanh(s / softcap) before the softmax (Gemma 2)
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write k and v into the cache, then attend. q (N, Hq, D), k and v (N, Hkv, D)
        -> (N, Hq * D)."""
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return self.attend(q, k, v, kv_cache, meta, window, sinks)

    def decode_splits(self, num_decode: int) -> int:
        """Programs each decode row's context is split over, for a step of
        ``num_decode`` decode rows."""
        return 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention for keys and values already in the cache (k and v are the step's
        own) -> (N, Hq * D). window > 0: a query at position p sees keys p - window + 1
        to p (a sliding window, the layer's); 0: keys 0 to p. sinks (Hq,): each head's
        sink logit (gpt-oss), in every query's softmax beside its scores, with no
        value: the output is scaled by 1 - the sink's share."""
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """The reference backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 softcap: float = 0.0) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, softcap)
        self.gqa = num_heads != num_kv_heads

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention for keys and values already in the cache (k and v are the step's
        own, used directly by chunks without a cached prefix)."""
        n, d = q.shape[0], self.head_dim
        out = q.new_zeros(n, self.num_heads, d)
        if meta.num_decode:
            out[:meta.num_decode] = self._decode(q[:meta.num_decode], kv_cache, meta, window,
                                                 sinks)
        starts, lens = meta.query_start_host, meta.seq_lens_host
        for s in range(meta.num_decode, len(lens)):
            rows = slice(starts[s], starts[s + 1])
            out[rows] = self._chunk(q[rows], k[rows], v[rows], kv_cache,
                                    meta.block_tables[s], lens[s], window, sinks)
        return out.view(n, self.num_heads * d)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """(2, num_blocks, bs, Hkv, D) cache, (...) ids -> (2, ..., bs, Hkv, D) in
        ``dtype`` (the queries')."""
        ids = block_ids.reshape(-1)
        if kv_cache.dtype == FP8:  # its values' blocks are laid out otherwise
            values = value_blocks(kv_cache).index_select(0, ids)
            gathered = torch.stack((kv_cache[0].index_select(0, ids).to(dtype),
                                    from_value_blocks(values).to(dtype)))
        else:
            gathered = torch.index_select(kv_cache, 1, ids).to(dtype)
        return gathered.view(2, *block_ids.shape, *kv_cache.shape[2:])

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                window: int = 0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, bs = q.shape[0], kv_cache.shape[2]
        lens = torch.tensor(meta.seq_lens_host[:b], device=q.device)
        width = -(-max(meta.seq_lens_host[:b]) // bs)
        tables = meta.block_tables[:b, :width]
        kv = self._gather(kv_cache, tables, q.dtype)  # (2, B, nb, bs, Hkv, D)
        kv = kv.view(2, b, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        keys = torch.arange(width * bs, device=q.device).unsqueeze(0)
        mask = keys < lens.unsqueeze(1)
        if window:
            mask &= keys >= lens.unsqueeze(1) - window
        out = self._sdpa(q.unsqueeze(2), kv[0], kv[1], mask.view(b, 1, 1, -1),
                         sinks=sinks)  # (B, Hq, 1, D)
        return out.squeeze(2)

    def _chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
               window: int = 0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        length = q.shape[0]
        if context_len == length and kv_cache.dtype == q.dtype and not window:
            # No cached prefix: attend within the chunk, causally. (A cache of another
            # dtype is read back, so that the chunk sees its keys rounded as every later
            # query will, and as the C kernels do.)
            keys, values, mask, causal = k, v, None, True
        else:
            blocks = block_table[:-(-context_len // kv_cache.shape[2])]
            kv = self._gather(kv_cache, blocks, q.dtype)  # (2, nb, bs, Hkv, D)
            kv = kv.view(2, -1, self.num_kv_heads, self.head_dim)[:, :context_len]
            q_pos = torch.arange(context_len - length, context_len, device=q.device)
            key_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
            mask = key_pos <= q_pos.unsqueeze(1)
            if window:
                mask &= key_pos > q_pos.unsqueeze(1) - window
            keys, values, causal = kv[0], kv[1], False
        out = self._sdpa(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                         mask, causal, sinks)  # (Hq, L, D)
        return out.transpose(0, 1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Optional[torch.Tensor], causal: bool = False,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Softmax(q k^T scale) v over the keys ``mask`` allows (or causally), q (...,
        Hq, L, D), k and v (..., Hkv, T, D); with a soft cap or sinks, computed here
        (SDPA has neither)."""
        if not self.softcap and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=self.scale, enable_gqa=self.gqa)
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                              device=q.device).tril()
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
        scores = soft_cap(q @ k.transpose(-1, -2) * self.scale, self.softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return torch.softmax(scores, -1) @ v
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
