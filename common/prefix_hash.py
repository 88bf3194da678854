"""The chained hash of a token prefix, block by block: one name for one thing, shared
by the engine's prefix cache (engine_worker/block_manager.py) and the frontend's
prefix-aware router (frontend/router.py).

The hash of block i covers its own token ids and, through its parent's hash, every
token before it: equal hashes mean equal whole prefixes (BLAKE2b-128; the engine also
compares the token ids on every hit).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence


def chain_hash(parent: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """Hash of a full block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    """The chained hashes of the leading full blocks of ``token_ids`` (at most
    ``max_blocks`` of them)."""
    hashes: list[bytes] = []
    parent = None
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
