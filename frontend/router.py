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
holder is over the bound, to the least loaded. Blocks the shared KV store is thought
to hold (as the engines that use it report their puts: StoreView) count as held by
every engine that uses it, so a prefix any engine computed ties them all, and the
least loaded of those takes it. Policy "least-loaded" ignores
prefixes; "round-robin" takes the healthy engines in turn (what a balancer that knows
nothing of the engines does: with a shared KV store, every engine finds what any
computed). A request counts toward its engine's load from the pick on, so a burst
still being tokenized spreads out. Only engines that accept work (ready, answering
heartbeats, not draining, not retired by membership: frontend/membership.py) are
picked; an engine that comes back as a new instance is known to hold nothing until
its snapshot arrives.
With no healthy engine the answer is 503 with Retry-After.

A LoRA adapter's request (the model field naming it) goes only to engines that serve
that adapter, and its blocks are hashed salted with the adapter's key on each engine
(its name and a fingerprint of its weights, AdapterInfo.key), as the engine hashes
them: it follows the prefix that adapter computed, never another's or the base
model's. It is not split between prefill and decode engines.

Prefill/decode disaggregation: engines say their role in Ready. ``pick`` chooses the
engine that decodes (and owns) a request among the engines that are not prefill
engines, as above, and takes a prefill engine only when no other engine is left.
``pick_prefill`` then chooses the prefill engine that computes the prompt and the
first token, the one holding most of the prompt's leading blocks (the least loaded
on a tie), or none: when no prefill engine is available, or when the blocks the
decode engine lacks come to fewer than ``min_prefill_tokens`` tokens (a round trip
and a transfer are not worth it; the decode engine computes the prompt itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from common.config import ROUTING_POLICIES
from common.prefix_hash import prefix_hashes
from common.protocol import Ready
from engine_worker.client import EngineClient, StoreView
from frontend.errors import APIError

POLICIES = ROUTING_POLICIES
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

    def matched_blocks(self, hashes: list[bytes], store: Optional[StoreView] = None) -> int:
        """The prompt's leading blocks this engine holds, or can pull from the shared
        KV store it uses (``store``: what the store is thought to hold)."""
        if not self.client.ready.prefix_caching:
            return 0
        holds = self.client.cache.holds
        n = 0
        for h in hashes:
            if not holds(h):
                break
            n += 1
        if store is not None and self.client.ready.kv_store:
            while n < len(hashes) and store.holds(hashes[n]):
                n += 1
        return n


class EngineRouter:
    def __init__(self, clients: Sequence[EngineClient], policy: str = "prefix",
                 min_prefill_tokens: int = 0, store: Optional[StoreView] = None) -> None:
        """store: what the shared KV store is thought to hold (engines that use it
        report their puts): counted as held by every engine that uses it."""
        self.store = store
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, "
                             f"got {policy!r}")
        self.policy = policy
        self.min_prefill_tokens = min_prefill_tokens
        self.engines: list[RoutedEngine] = []
        self._by_client: dict[int, RoutedEngine] = {}
        self._turn = 0   # round-robin's next
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

    def pick(self, prompt_token_ids: Sequence[int], cache_salt: Optional[str] = None,
             exclude: Optional[EngineClient] = None, adapter: Optional[str] = None
             ) -> EngineClient:
        """The engine for a request with this prompt and cache salt (other than
        ``exclude``, the one a retried request left); counts it toward that engine's
        load until release()."""
        return self._pick(prompt_token_ids, cache_salt, exclude, False, adapter)[0]

    def route(self, prompt_token_ids: Sequence[int], cache_salt: Optional[str] = None,
              adapter: Optional[str] = None
              ) -> tuple[EngineClient, Optional[EngineClient]]:
        """The engine that decodes a request with this prompt and cache salt, and the
        prefill engine that computes its prompt (or None); each counted toward its
        engine's load until release(). ``adapter``: the request's LoRA adapter, which
        only engines that serve it take."""
        return self._pick(prompt_token_ids, cache_salt, None, True, adapter)

    def live(self) -> list[EngineClient]:
        """The engines that are up (not retired, not known dead)."""
        return [e.client for e in self.engines
                if not e.retired and e.client.dead_reason is None and e.client.ready]

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters some engine serves (name -> path)."""
        out: dict[str, str] = {}
        for e in self.engines:
            if not e.retired:
                out.update({a.name: a.path for a in e.client.adapters.values()})
        return out

    def _pick(self, prompt_token_ids: Sequence[int], cache_salt: Optional[str],
              exclude: Optional[EngineClient], disaggregate: bool,
              adapter: Optional[str] = None) -> tuple[EngineClient, Optional[EngineClient]]:
        candidates = [e for e in self.engines if not e.retired and e.client is not exclude
                      and (adapter is None or adapter in e.client.adapters)]
        if adapter is not None and not candidates:
            raise APIError(404, f"the model '{adapter}' is not loaded on any engine",
                           param="model", code="model_not_found")
        healthy = [e for e in candidates if e.client.accepting]
        # Prefill engines decode only when nothing else can.
        healthy = [e for e in healthy if e.client.ready.role != "prefill"] or healthy
        if not healthy:
            reasons = "; ".join(f"{e.address}: {e.client.dead_reason or 'draining'}"
                                for e in candidates)
            raise APIError(503, f"no engine is available ({reasons or 'none is known'})",
                           code="engine_unavailable", headers={"Retry-After": "1"})
        hashes_by: dict[tuple[int, Optional[str]], list[bytes]] = {}

        def hashes(e: RoutedEngine) -> list[bytes]:
            # (by block size, and by the adapter's key on that engine: its name and
            # weights, which salt the engine's own hashes of the request's blocks)
            key = (e.client.ready.block_size,
                   None if adapter is None else e.client.adapters[adapter].key)
            if key not in hashes_by:
                hashes_by[key] = prefix_hashes(prompt_token_ids, key[0], MAX_ROUTING_BLOCKS,
                                               cache_salt, key[1])
            return hashes_by[key]

        chosen: Optional[RoutedEngine] = None
        by_prefix = self.policy == "prefix"
        if by_prefix:
            min_load = min(e.load for e in healthy)
            bound = min_load + max(MIN_SLACK, SLACK_FRACTION * min_load)
            best = 0
            for e in healthy:
                if e.load > bound:
                    continue
                n = e.matched_blocks(hashes(e), self.store)
                if n > best or (n == best and n and chosen is not None and e.load < chosen.load):
                    best, chosen = n, e
            if chosen is not None:
                chosen.num_prefix_routed += 1
        if self.policy == "round-robin":
            chosen = healthy[self._turn % len(healthy)]
            self._turn += 1
        if chosen is None:
            chosen = min(healthy, key=lambda e: (e.load, e.num_routed))
        prefill = None
        if disaggregate and adapter is None and chosen.client.ready.role != "prefill":
            # What the decode engine holds, before this request's blocks are expected.
            uncached = len(prompt_token_ids) - (chosen.matched_blocks(hashes(chosen), self.store)
                                                * chosen.client.ready.block_size)
            if uncached >= max(1, self.min_prefill_tokens):
                prefill = self._pick_prefill(chosen.client.ready.block_size, hashes(chosen))
        if by_prefix and chosen.client.ready.prefix_caching:
            chosen.client.cache.expect(hashes(chosen), chosen.client.ready.num_kv_blocks)
        chosen.load += 1
        chosen.num_routed += 1
        return chosen.client, prefill

    def _pick_prefill(self, block_size: int, hashes: list[bytes]) -> Optional[EngineClient]:
        """The prefill engine holding most of the prompt's leading blocks (the least
        loaded on a tie), among those with the decode engine's block size (their KV
        blocks are of no use to it otherwise)."""
        healthy = [e for e in self.engines if not e.retired and e.client.accepting
                   and e.client.ready.role == "prefill"
                   and e.client.ready.block_size == block_size]
        if not healthy:
            return None
        chosen = min(healthy, key=lambda e: (-e.matched_blocks(hashes, self.store), e.load,
                                               e.num_routed))
        if chosen.client.ready.prefix_caching:
            chosen.client.cache.expect(hashes, chosen.client.ready.num_kv_blocks)
        chosen.load += 1
        chosen.num_routed += 1
        return chosen.client

    def release(self, client: EngineClient) -> None:
        self._by_client[id(client)].load -= 1
