"""Engines found through DNS (frontend/membership.py) with a fake resolver: joining,
leaving once their requests end, flapping, failed lookups, fixed addresses."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest

from common.protocol import Ready
from frontend.membership import Membership, dns_name, resolve
from frontend.router import EngineRouter

PROMPT = [1, 2, 3, 4, 5]


class FakeClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.ready = Ready(engine_id=address, protocol_version=1, model_name="tiny",
                           max_model_len=512, vocab_size=1000, num_kv_blocks=64, block_size=4,
                           eos_token_ids=[2])
        self.dead_reason: Optional[str] = None
        self.draining = False
        self.connected = self.closed = False

    @property
    def accepting(self) -> bool:
        return self.dead_reason is None and not self.draining

    async def connect(self) -> None:
        self.connected = True

    async def close(self) -> None:
        self.closed = True


class FakeDNS:
    """Answers from a dict; a name set to None fails its lookup."""

    def __init__(self, **answers) -> None:
        self.answers = answers
        self.lookups = 0

    async def __call__(self, host: str):
        self.lookups += 1
        return self.answers[host.replace(".", "_")]


def setup(*addresses: str, **answers):
    router = EngineRouter([], policy="least-loaded")
    clients: dict[str, FakeClient] = {}

    def make(address: str) -> FakeClient:
        clients[address] = FakeClient(address)
        return clients[address]

    dns = FakeDNS(**answers)
    return Membership(addresses, router, make, resolver=dns), router, clients, dns


def addresses(router: EngineRouter) -> dict[str, bool]:
    """Each engine's address: whether it is retired."""
    return {e.address: e.retired for e in router.engines}


def test_which_addresses_are_names():
    assert dns_name("tcp://tasks.engine:5557") == ("tasks.engine", "5557")
    assert dns_name("tcp://engine-0:5557") == ("engine-0", "5557")
    for fixed in ("tcp://10.0.0.5:5557", "tcp://[::1]:5557", "ipc:///tmp/e.sock", "tcp://*:5557"):
        assert dns_name(fixed) is None, fixed


def test_engines_join_and_leave_once_their_requests_end():
    async def scenario():
        m, router, clients, dns = setup("tcp://tasks.engine:5557", "ipc:///run/fixed.sock",
                                        tasks_engine=["10.0.0.2", "10.0.0.1"])
        await m.refresh()
        assert addresses(router) == {"tcp://10.0.0.2:5557": False, "tcp://10.0.0.1:5557": False,
                                     "ipc:///run/fixed.sock": False}
        assert all(c.connected for c in clients.values())
        # A third replica starts.
        dns.answers["tasks_engine"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
        await m.refresh()
        assert len(router.engines) == 4 and clients["tcp://10.0.0.3:5557"].connected
        # One holding a request leaves: retired (not picked), kept until it is idle.
        busy = router._by_client[id(clients["tcp://10.0.0.1:5557"])]
        busy.load = 1
        dns.answers["tasks_engine"] = ["10.0.0.2", "10.0.0.3"]
        await m.refresh()
        assert addresses(router)["tcp://10.0.0.1:5557"] is True
        picks = {router.pick(PROMPT).address for _ in range(9)}
        assert "tcp://10.0.0.1:5557" not in picks and len(picks) == 3
        assert not clients["tcp://10.0.0.1:5557"].closed
        router.release(busy.client)  # its request ended
        await m.refresh()
        assert "tcp://10.0.0.1:5557" not in addresses(router)
        assert clients["tcp://10.0.0.1:5557"].closed
    asyncio.run(scenario())


def test_a_flapping_answer_reinstates_the_same_engine():
    async def scenario():
        m, router, clients, dns = setup("tcp://tasks.engine:5557", tasks_engine=["10.0.0.1"])
        await m.refresh()
        only = router.engines[0]
        only.load = 2
        dns.answers["tasks_engine"] = []  # gone from one answer ...
        await m.refresh()
        assert only.retired
        with pytest.raises(Exception, match="none is known"):
            router.pick(PROMPT)
        dns.answers["tasks_engine"] = ["10.0.0.1"]  # ... back in the next
        await m.refresh()
        assert router.engines == [only] and not only.retired and only.load == 2
        assert list(clients) == ["tcp://10.0.0.1:5557"]  # the same client throughout
    asyncio.run(scenario())


def test_a_failed_lookup_changes_nothing_and_a_missing_name_means_no_engines():
    async def scenario():
        m, router, clients, dns = setup("tcp://tasks.engine:5557",
                                        tasks_engine=["10.0.0.1", "10.0.0.2"])
        await m.refresh()
        dns.answers["tasks_engine"] = None  # the DNS server did not answer
        await m.refresh()
        assert addresses(router) == {"tcp://10.0.0.1:5557": False, "tcp://10.0.0.2:5557": False}
        dns.answers["tasks_engine"] = []  # scaled to zero: the name has no address
        await m.refresh()
        assert list(router.remove_idle_retired()) == [] and router.engines == []
        assert all(c.closed for c in clients.values())
    asyncio.run(scenario())


def test_ipv6_answers_and_the_real_resolver():
    async def scenario():
        m, router, _, _ = setup("tcp://tasks.engine:5557", tasks_engine=["fd00::7"])
        await m.refresh()
        assert addresses(router) == {"tcp://[fd00::7]:5557": False}
        # The system resolver: localhost exists, a reserved .invalid name does not.
        assert "127.0.0.1" in (await resolve("localhost") or [])
        assert await resolve("no-such-engine.invalid") == []
    asyncio.run(scenario())


def test_fixed_addresses_need_no_task():
    async def scenario():
        m, router, _, dns = setup("ipc:///run/a.sock", "tcp://127.0.0.1:5557")
        await m.refresh()
        m.start()
        assert m._task is None and dns.lookups == 0 and len(router.engines) == 2
    asyncio.run(scenario())
