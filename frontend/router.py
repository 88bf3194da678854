"""Which engine serves a request.

Model: an engine's prefix cache holds the prompts it served recently, in blocks of
block_size tokens named by chained hashes (common/prefix_hash.py, the engines' own
hash). Each engine tells every frontend exactly which hashes it holds, as they change
(CacheEvents; each engine client's ``cache``, engine_worker/client.py), so every
frontend sees the blocks any frontend's requests left there, and evictions. Added to
that: the blocks of prompts this frontend has just sent an engine and the engine has
not computed yet (``expected``), so that a burst sharing a prefix follows its first
request. A request whose leading blocks an engine holds will find them cached there.

Policy "prefix" (the default): among healthy engines whose load (requests assigned
and not yet finished) is within the imbalance bound of the least loaded one,
``min_load + max(MIN_SLACK, SLACK_FRACTION * min_load)``, the request goes to the one
holding the longest run of its leading blocks; when no engine holds any, or every
holder is over the bound, to the least loaded. Policy "least-loaded" ignores
prefixes. A request counts toward its engine's load from the pick on, so a burst
still being tokenized spreads out. Only engines that accept work (ready, answering
heartbeats, not draining, not retired by membership: frontend/membership.py) are
picked; an engine that comes back as a new instance is known to hold nothing until
its snapshot arrives.
With no healthy engine the answer is 503 with Retry-After.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from common.prefix_hash import prefix_hashes
from common.protocol import Ready
from engine_worker.client import EngineClient
from frontend.errors import APIError

POLICIES = ("prefix", "least-loaded")
# Imbalance bound: an engine may take a request for its prefix while its load is at
# most this much above the least loaded engine's.
MIN_SLACK = 4
SLACK_FRACTION = 0.5
# Prompts are matched on at most this many leading blocks (4,096 tokens of 16).
MAX_ROUTING_BLOCKS = 256


@dataclass
class RoutedEngine:
    client: EngineClient
    # Requests assigned and not finished.
    load: int = 0
    # Requests routed here since the frontend started, and how many of them went here
    # for a prefix this engine held.
    num_routed: int = 0
    num_prefix_routed: int = 0
    # Gone from the engines' DNS answer (frontend/membership.py): routed nothing
    # new, removed once its load is 0.
    retired: bool = False

    @property
    def address(self) -> str:
        return self.client.address

    def matched_blocks(self, hashes: list[bytes]) -> int:
        if not self.client.ready.prefix_caching:
            return 0
        holds = self.client.cache.holds
        n = 0
        for h in hashes:
            if not holds(h):
                break
            n += 1
        return n


class EngineRouter:
    def __init__(self, clients: Sequence[EngineClient], policy: str = "prefix") -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.engines: list[RoutedEngine] = []
        self._by_client: dict[int, RoutedEngine] = {}
        for client in clients:
            self.add(client)

    def add(self, client: EngineClient) -> None:
        e = RoutedEngine(client)
        self.engines.append(e)
        self._by_client[id(client)] = e

    def remove_idle_retired(self) -> list[EngineClient]:
        """Forget the retired engines nothing is assigned to; their clients, to close."""
        gone = [e for e in self.engines if e.retired and e.load == 0]
        for e in gone:
            self.engines.remove(e)
            del self._by_client[id(e.client)]
        return [e.client for e in gone]

    @property
    def clients(self) -> list[EngineClient]:
        return [e.client for e in self.engines]

    def ready(self) -> Optional[Ready]:
        """Some engine's Ready (its limits), or None before any has started."""
        return next((e.client.ready for e in self.engines if e.client.ready is not None), None)

    def pick(self, prompt_token_ids: Sequence[int],
             exclude: Optional[EngineClient] = None) -> EngineClient:
        """The engine for a request with this prompt (other than ``exclude``, the one
        a retried request left); counts it toward that engine's load until
        release()."""
        candidates = [e for e in self.engines if not e.retired and e.client is not exclude]
        healthy = [e for e in candidates if e.client.accepting]
        if not healthy:
            reasons = "; ".join(f"{e.address}: {e.client.dead_reason or 'draining'}"
                                for e in candidates)
            raise APIError(503, f"no engine is available ({reasons or 'none is known'})",
                           code="engine_unavailable", headers={"Retry-After": "1"})
        hashes_by_size: dict[int, list[bytes]] = {}

        def hashes(e: RoutedEngine) -> list[bytes]:
            size = e.client.ready.block_size
            if size not in hashes_by_size:
                hashes_by_size[size] = prefix_hashes(prompt_token_ids, size, MAX_ROUTING_BLOCKS)
            return hashes_by_size[size]

        chosen: Optional[RoutedEngine] = None
        if self.policy == "prefix":
            min_load = min(e.load for e in healthy)
            bound = min_load + max(MIN_SLACK, SLACK_FRACTION * min_load)
            best = 0
            for e in healthy:
                if e.load > bound:
                    continue
                n = e.matched_blocks(hashes(e))
                if n > best or (n == best and n and chosen is not None and e.load < chosen.load):
                    best, chosen = n, e
            if chosen is not None:
                chosen.num_prefix_routed += 1
        if chosen is None:
            chosen = min(healthy, key=lambda e: (e.load, e.num_routed))
        if self.policy == "prefix" and chosen.client.ready.prefix_caching:
            chosen.client.cache.expect(hashes(chosen), chosen.client.ready.num_kv_blocks)
        chosen.load += 1
        chosen.num_routed += 1
        return chosen.client

    def release(self, client: EngineClient) -> None:
        self._by_client[id(client)].load -= 1
