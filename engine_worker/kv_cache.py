"""The KV cache's tensors, one a layer, and how many blocks a memory budget holds.

Each layer's cache is keys and values, (2, num_blocks, block_size, H_kv, D)
(attention.kv_cache_shape). Sliding-window layers' blocks are let go of as the window
passes (window_blocks.py), unless the config says not (CacheConfig.window_pool):
mixed with full layers, in a pool of their own (``windowed``), sized for what the
batch's windows can hold (window_blocks.local_pool_blocks) and split from the same
budget (window_blocks.split_pool); every layer sliding, in the one pool (``sliding``),
whose block 0 is the null block released entries point at.
"""

from __future__ import annotations

from typing import Optional

import torch

from common.config import CacheConfig
from engine_worker.attention import kv_cache_shape
from engine_worker.models.config import ModelConfig
from engine_worker.ops import FP8
from engine_worker.window_blocks import local_pool_blocks, split_pool

# A CPU engine's KV cache where no size is given (host memory)
DEFAULT_KV_BYTES = 2 << 30

# --kv-cache-dtype: the cache's element type (None: auto, the platform's choice once the
# weights are loaded)
_KV_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": FP8}


def kv_cache_dtype(name: str) -> Optional[torch.dtype]:
    return _KV_DTYPES[name]


class KvCache:
    def __init__(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                 device: torch.device, window_pool: bool, max_seqs: int,
                 token_budget: int, share: float = 1.0) -> None:
        """cfg: as this rank sees it (its KV heads); share: this rank's part of a byte
        budget the config gives (the engine's, in all: its tensor-parallel ranks share
        it by the KV heads each holds)."""
        self.cfg, self.block_size, self.dtype, self.device = cfg, block_size, dtype, device
        self.share = share
        windows = cfg.windows or (0,)
        self.window = max(windows) if window_pool else 0
        self.windowed = self.window > 0 and 0 in windows
        self.sliding = self.window > 0 and 0 not in windows
        self._local_needed = (local_pool_blocks(self.window, block_size, max_seqs, token_budget)
                              if self.windowed else 0)
        # each layer's cache (the same list for the life of the engine: forwards hold it)
        self.layers: list[torch.Tensor] = []
        self.num_blocks = 0
        self.num_local_blocks = 0  # the sliding layers' pool's, its null block included

    def layer_block_bytes(self) -> int:
        """One layer's keys and values of one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.cfg.num_kv_heads * self.cfg.head_dim * elem

    def blocks_in(self, budget: int) -> tuple[int, int]:
        """(blocks, the sliding layers' own blocks or 0) a KV memory budget holds."""
        cfg, per_layer = self.cfg, self.layer_block_bytes()
        num_local_layers = sum(1 for w in cfg.windows if w) if self.windowed else 0
        num_blocks, num_local = split_pool(budget, per_layer, cfg.num_layers - num_local_layers,
                                           num_local_layers, self._local_needed)
        num_blocks -= self.sliding  # the null block
        if num_blocks < 1:
            raise ValueError(f"a KV memory budget of {budget} bytes holds no block of "
                             f"{per_layer * cfg.num_layers} bytes")
        return num_blocks, num_local

    def sized(self, cache: CacheConfig) -> tuple[int, int]:
        """(blocks, the sliding layers' own) as the config gives them, or as many as
        its byte budget holds (DEFAULT_KV_BYTES where it gives none)."""
        if cache.num_blocks:
            return self.given(cache.num_blocks)
        return self.given_bytes(cache.kv_cache_memory_bytes or DEFAULT_KV_BYTES)

    def given_bytes(self, budget: int) -> tuple[int, int]:
        """The blocks of a byte budget the config gives the engine (its ranks share it:
        each holds its heads of every block)."""
        return self.blocks_in(int(budget * self.share))

    def given(self, num_blocks: int) -> tuple[int, int]:
        """--num-blocks: the full layers' pool; the sliding layers' holds what its
        requests can use of their windows, at most as many."""
        if not self.windowed:
            return num_blocks, 0
        return num_blocks, min(self._local_needed, num_blocks) + 1

    def allocate(self, num_blocks: int, num_local: int = 0) -> None:
        """Each layer's cache: the sliding layers' of ``num_local`` blocks where they
        have a pool of their own (else of ``num_blocks``); ``num_blocks`` counts the
        null block where every layer slides."""
        cfg = self.cfg

        def cache(blocks: int) -> torch.Tensor:
            # Zeroed, not empty: padded reads of unused slots are masked out, but
            # garbage there could be NaN, and 0 * NaN would leak through the softmax.
            shape = kv_cache_shape(blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.layers[:] = [cache(num_local if num_local and cfg.windows[i] else num_blocks)
                          for i in range(cfg.num_layers)]

    def zero_null_block(self) -> None:
        """The null block after made-up steps wrote there (their requests have no
        local table, or own block 0 where every layer slides): released entries must
        read zeros."""
        for i, c in enumerate(self.layers):
            if self.sliding or (self.windowed and self.cfg.windows[i]):
                c[:, 0].zero_()

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.layers)
