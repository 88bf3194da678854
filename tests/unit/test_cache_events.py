"""Exact routing state: an engine publishes its prefix cache's changes (CacheEvents),
each client mirrors them (CacheView), a gap asks for a snapshot, and routers route by
what every engine holds, whichever frontend sent it there. In process; from real
engine processes: tests/e2e/test_cache_events_served.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

from common.prefix_hash import prefix_hashes, salt_root
from common.protocol import CacheEvents, Ready
from engine_worker.block_manager import BlockManager, BlockTable
from engine_worker.client import RESYNC_INTERVAL_S, CacheView
from frontend.router import EngineRouter


def held_after(changes_log: list[tuple[list[bytes], list[bytes]]]) -> set[bytes]:
    view = CacheView()
    view.apply(CacheEvents(seq=0, snapshot=True), 0.0)
    for seq, (stored, removed) in enumerate(changes_log, 1):
        assert not set(stored) & set(removed)
        assert view.apply(CacheEvents(seq=seq, stored=stored, removed=removed), 0.0) is False
    return view.held


def test_the_change_log_replays_to_exactly_what_the_cache_holds():
    """Random allocations, frees (to eviction), failed-step forgets and resets: after
    every operation, the changes taken so far replay to the cache's hash set."""
    rng = random.Random(5)
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    bm.record_changes()
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live: list[tuple[BlockTable, list[int]]] = []
    log = []
    for _ in range(400):
        op = rng.random()
        if op < 0.5 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(9))]
            table = BlockTable()
            hits = bm.find_cached_prefix(table, tokens)
            if bm.allocate(table, tokens, len(tokens), hits):
                live.append((table, tokens))
        elif op < 0.85:
            table, _ = live.pop(rng.randrange(len(live)))
            bm.free(table)
        elif op < 0.97:
            table, tokens = rng.choice(live)
            bm.forget_from(table, rng.randrange(len(tokens) + 1))
        else:
            bm.reset_prefix_cache()
        log.append(bm.take_changes())
        assert held_after(log) == set(bm.cached_hashes())
    assert sum(len(removed) for _, removed in log) > 20  # evictions happened


def test_nothing_is_recorded_unless_asked():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    assert bm.allocate(BlockTable(), list(range(8)), 8)
    assert bm.take_changes() == ([], [])
    assert len(bm.cached_hashes()) == 2


def test_a_view_applies_changes_in_order_and_asks_for_a_snapshot_on_a_gap():
    a, b, c, d = b"a" * 16, b"b" * 16, b"c" * 16, b"d" * 16
    view = CacheView()
    assert not view.apply(CacheEvents(seq=1, stored=[a]), 0.0)  # before any snapshot
    assert view.held == set()
    assert not view.apply(CacheEvents(seq=2, stored=[a, b], snapshot=True), 0.0)
    assert not view.apply(CacheEvents(seq=2, stored=[c]), 0.0)  # already in the snapshot
    assert view.held == {a, b}
    assert not view.apply(CacheEvents(seq=3, stored=[c], removed=[a]), 0.0)
    assert view.held == {b, c} and view.seq == 3
    # Change 4 was lost: the view keeps what it knows and asks, once a second at most.
    assert view.apply(CacheEvents(seq=5, stored=[d]), 10.0)
    assert not view.apply(CacheEvents(seq=6, removed=[b]), 10.0 + RESYNC_INTERVAL_S / 2)
    assert view.apply(CacheEvents(seq=7), 10.0 + RESYNC_INTERVAL_S)
    assert view.held == {b, c} and view.num_resyncs == 2
    assert not view.apply(CacheEvents(seq=7, stored=[c, d], snapshot=True), 12.0)
    assert view.held == {c, d} and view.seq == 7
    assert not view.apply(CacheEvents(seq=8, removed=[c]), 12.0)
    assert view.held == {d}
    view.reset()  # a new engine instance
    assert view.held == set() and view.seq is None


def test_expectations_are_settled_by_changes_and_bounded():
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    view = CacheView()
    view.apply(CacheEvents(seq=0, stored=[a], snapshot=True), 0.0)
    view.expect([a, b, c], capacity=8)
    assert list(view.expected) == [b, c]  # a is held already
    assert view.holds(b) and view.holds(c)
    view.apply(CacheEvents(seq=1, stored=[b]), 0.0)
    view.apply(CacheEvents(seq=2, removed=[c]), 0.0)  # stored and evicted before we heard
    assert list(view.expected) == [] and view.holds(b) and not view.holds(c)
    view.expect([bytes([i]) * 16 for i in range(10)], capacity=4)
    assert len(view.expected) == 4


class Engine:
    """What the router reads of an EngineClient, with a real CacheView."""

    def __init__(self, name: str, num_kv_blocks: int = 64) -> None:
        self.address = f"fake://{name}"
        self.ready = Ready(engine_id=name, model_name="tiny", max_model_len=512,
                           vocab_size=1000, num_kv_blocks=num_kv_blocks, block_size=4,
                           eos_token_ids=[2])
        self.dead_reason = None
        self.accepting = True
        self.cache = CacheView()
        self.cache.apply(CacheEvents(seq=0, snapshot=True), 0.0)
        self.seq = 0

    def publish(self, stored=(), removed=()) -> None:
        self.seq += 1
        self.cache.apply(CacheEvents(seq=self.seq, stored=list(stored),
                                     removed=list(removed)), 0.0)


def two_frontends():
    """Two routers over the same two engines: each frontend has its own clients, and
    every client hears every change of its engine."""
    names = ("e0", "e1")
    clients = [[Engine(n) for n in names] for _ in range(2)]
    routers = [EngineRouter(c) for c in clients]

    def publish(engine: int, **kw) -> None:
        for c in clients:
            c[engine].publish(**kw)

    return routers, publish


def test_a_frontend_routes_to_the_blocks_another_frontend_left():
    routers, publish = two_frontends()
    prompt = list(range(100, 140))  # ten blocks of 4
    first = routers[0].pick(prompt)
    engine = 0 if first.address == "fake://e0" else 1
    # The other frontend knows nothing of it until the engine reports the blocks.
    routers[1].pick([7] * 40)  # load on one engine, so the next pick is not a tie
    publish(engine, stored=prefix_hashes(prompt, 4, 256))
    assert routers[1].pick(prompt[:32] + [9] * 8).address == first.address
    # The engine evicts the blocks: no frontend routes by them any more.
    publish(engine, removed=prefix_hashes(prompt, 4, 256))
    assert all(r.engines[engine].matched_blocks(prefix_hashes(prompt, 4, 256)) == 0
               for r in routers[1:])


def test_a_salted_prompt_routes_to_the_blocks_of_its_salt():
    """The router hashes a prompt with its cache salt as the engine's prefix cache
    does, so a tenant's request goes where its own salt's blocks are."""
    prompt = list(range(100, 140))
    table = BlockTable(root=salt_root("tenant-a"))
    BlockManager(16, 4, True).hash_blocks(table, prompt, len(prompt))
    assert table.block_hashes == prefix_hashes(prompt, 4, 256, "tenant-a")
    assert not set(table.block_hashes) & set(prefix_hashes(prompt, 4, 256))
    routers, publish = two_frontends()
    publish(0, stored=table.block_hashes)
    publish(1, stored=prefix_hashes(prompt, 4, 256))
    router = routers[1]
    assert router.pick(prompt, "tenant-a").address == "fake://e0"
    assert router.pick(prompt).address == "fake://e1"
    assert router.pick(prompt, "tenant-a").address == "fake://e0"


def test_without_events_a_frontend_follows_only_its_own_expectations():
    routers, _ = two_frontends()
    prompt = list(range(100, 140))
    a = routers[0].pick(prompt)
    routers[0].release(a)
    assert routers[0].pick(prompt).address == a.address  # expected there
    hashes = prefix_hashes(prompt, 4, 256)
    assert [r.engines[i].matched_blocks(hashes) for r in routers for i in (0, 1)].count(10) == 1


def test_an_adapters_request_follows_the_prefix_its_adapter_computed():
    """An adapter's blocks are salted by the engine with its key (its name and a
    fingerprint of its weights), which engines report: the router hashes an adapter's
    request with that engine's key, so that it follows the blocks that adapter computed
    there, never the base model's or another adapter's, and expects its blocks salted."""
    from common.protocol import AdapterInfo

    engines = [Engine("e0"), Engine("e1")]
    for e, key in zip(engines, ("lora-a:1", "lora-a:2")):   # (the same name, other weights)
        e.adapters = {"lora-a": AdapterInfo(name="lora-a", path="/a", rank=8, key=key)}
    router = EngineRouter(engines)
    held, fresh = list(range(100, 140)), list(range(200, 240))   # ten blocks of 4 each
    engines[0].publish(stored=prefix_hashes(held, 4, 256))       # the base model's
    engines[1].publish(stored=prefix_hashes(held, 4, 256, None, "lora-a:2"))
    assert router.pick(held, adapter="lora-a").address == "fake://e1"   # its own blocks
    assert router.pick(held, adapter="lora-a").address == "fake://e1"
    assert [e.num_prefix_routed for e in router.engines] == [0, 2]
    assert router.pick(held).address == "fake://e0"   # the base model's, beside them
    chosen = router.pick(fresh, adapter="lora-a")
    assert chosen.address == "fake://e0"   # (the least loaded: no one holds it)
    assert list(chosen.cache.expected)[-10:] == prefix_hashes(fresh, 4, 256, None, "lora-a:1")


# -- against a real engine process ---------------------------------------------------


def test_the_router_ignores_an_engine_without_a_prefix_cache():
    engine = Engine("e0")
    engine.ready = SimpleNamespace(**{**{f: getattr(engine.ready, f)
                                         for f in engine.ready.__struct_fields__},
                                      "prefix_caching": False})
    router = EngineRouter([engine])
    prompt = list(range(40))
    router.pick(prompt)
    assert list(engine.cache.expected) == []
    assert router.engines[0].matched_blocks(prefix_hashes(prompt, 4, 256)) == 0
