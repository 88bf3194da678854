"""The chained hash of a token prefix, block by block: one name for one thing, shared
by the engine's prefix cache (engine_worker/block_manager.py) and the frontend's
prefix-aware router (frontend/router.py).

The hash of block i covers its own token ids and, through its parent's hash, every
token before it: equal hashes mean equal whole prefixes (BLAKE2b-128; the engine also
compares the token ids on every hit).

A request's cache salt (vLLM's ``cache_salt``) seeds the chain: its first block's
parent is the salt's own hash, so requests with different salts (or one without) never
share a block, and nobody can learn from a prefix cache hit's speed what another
tenant's prompts hold.
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


def salt_root(cache_salt: Optional[str], adapter: Optional[str] = None) -> Optional[bytes]:
    """The parent of a salted request's first block (None without a salt); a LoRA
    adapter's key (engine_worker/lora.py) salts it too: KV computed under one adapter
    is never another's."""
    if cache_salt is None and adapter is None:
        return None
    salt = b"cache_salt\0" + (cache_salt or "").encode()
    if adapter is not None:
        salt += b"\0adapter\0" + adapter.encode()
    return hashlib.blake2b(salt, digest_size=16).digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int,
                  cache_salt: Optional[str] = None, adapter: Optional[str] = None
                  ) -> list[bytes]:
    """The chained hashes of the leading full blocks of ``token_ids`` (at most
    ``max_blocks`` of them), salted with ``cache_salt`` and a LoRA adapter's key."""
    hashes: list[bytes] = []
    parent = salt_root(cache_salt, adapter)
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
