"""A made-up step for measuring what a forward pass costs in memory (the CUDA engine's
KV sizing): requests of zeros that own consecutive blocks of a small cache."""

from __future__ import annotations

from common.protocol import SamplingParams
from engine_worker.block_manager import BlockTable
from engine_worker.request import Request
from engine_worker.scheduler import ScheduledRequest


def dummy_step(num_tokens: int, num_seqs: int, block_size: int, max_blocks_per_seq: int
               ) -> tuple[list[ScheduledRequest], int]:
    """num_tokens prompt tokens over num_seqs fresh requests (as even as can be, each
    within max_blocks_per_seq blocks), every one sampling. Returns the step and the
    blocks it needs."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    per_seq = min(-(-num_tokens // num_seqs), max_blocks_per_seq * block_size)
    scheduled, next_block = [], 0
    left = num_tokens
    for i in range(num_seqs):
        n = min(per_seq, left - (num_seqs - i - 1)) if i < num_seqs - 1 else min(per_seq, left)
        if n < 1:
            break
        left -= n
        request = Request(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1), 1,
                          frozenset())
        blocks = -(-n // block_size)
        request.blocks = BlockTable(block_ids=list(range(next_block, next_block + blocks)))
        next_block += blocks
        scheduled.append(ScheduledRequest(request, n))
    return scheduled, next_block
