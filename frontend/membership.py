"""Which engines the frontend routes to: the configured addresses, with DNS names
re-resolved.

An engine address is fixed (``ipc://...``, ``tcp://10.0.0.5:5557``) or names a DNS
name (``tcp://tasks.engine:5557``): then every address the name resolves to is an
engine on that port, and the name is resolved again every ``interval_s``. Docker
Swarm's ``tasks.<service>`` and a Kubernetes headless Service both answer with one
address per running replica, so engines join and leave without a frontend restart.

- A new address gets a client, connected at once (it is routed to once its Ready
  arrives, as any engine).
- An address no longer in the answer is retired: routed nothing new, and removed
  (its client closed) once the requests on it have ended. If it comes back first
  (a flapping answer) it is reinstated as it was.
- A name that does not exist (NXDOMAIN: a service scaled to zero) resolves to no
  engines; a failed lookup (a DNS server that does not answer) changes nothing,
  so a DNS outage never takes engines out of routing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Awaitable, Callable, Optional, Sequence

from engine_worker.client import EngineClient
from frontend.router import EngineRouter

logger = logging.getLogger(__name__)

# What a name resolves to: its addresses, or None when the lookup failed (not an
# answer: the last one stands).
Resolver = Callable[[str], Awaitable[Optional[list[str]]]]


def dns_name(address: str) -> Optional[tuple[str, str]]:
    """(host, port) of a tcp:// address whose host is a DNS name; None for a fixed
    address (ipc://, an IP literal, a wildcard)."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if not host or host == "*":
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        return host, port


async def resolve(host: str) -> Optional[list[str]]:
    """The IPv4 and IPv6 addresses of ``host`` (in a worker thread: getaddrinfo
    blocks); [] when the name does not exist, None when the lookup failed."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                             type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        logger.warning("cannot resolve %s: %s; keeping its engines", host, e)
        return None
    return sorted({info[4][0] for info in infos})


def tcp_address(ip: str, port: str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class Membership:
    def __init__(self, addresses: Sequence[str], router: EngineRouter,
                 make_client: Callable[[str], EngineClient], interval_s: float = 5.0,
                 resolver: Resolver = resolve) -> None:
        self.addresses = list(addresses)
        self.router = router
        self.make_client = make_client
        self.interval_s = interval_s
        self.resolver = resolver
        # The last answer for each name.
        self.answers: dict[str, list[str]] = {}
        self._task: Optional[asyncio.Task] = None

    @property
    def dynamic(self) -> bool:
        return any(dns_name(a) is not None for a in self.addresses)

    async def refresh(self) -> None:
        """Resolve every name once; add, retire, reinstate and remove engines to match."""
        wanted: list[str] = []
        for address in self.addresses:
            name = dns_name(address)
            if name is None:
                wanted.append(address)
                continue
            host, port = name
            answer = await self.resolver(host)
            if answer is None:  # the lookup failed: what it last said stands
                answer = self.answers.get(host, [])
            elif answer != self.answers.get(host):
                logger.info("%s resolves to %s", host, ", ".join(answer) or "nothing")
            self.answers[host] = answer
            wanted += [tcp_address(ip, port) for ip in answer]
        current = {e.address: e for e in self.router.engines}
        for address in dict.fromkeys(wanted):
            e = current.get(address)
            if e is None:
                logger.info("engine %s joined", address)
                client = self.make_client(address)
                try:
                    await client.connect()
                except Exception as error:  # an address ZeroMQ refuses: the rest go on
                    logger.error("cannot connect to engine %s: %s", address, error)
                    await client.close()
                    continue
                self.router.add(client)
            elif e.retired:
                logger.info("engine %s is back", address)
                e.retired = False
        for address, e in current.items():
            if address not in wanted and not e.retired:
                logger.info("engine %s left: routing it nothing new (%d request(s) on it)",
                            address, e.load)
                e.retired = True
        for client in self.router.remove_idle_retired():
            logger.info("engine %s removed", client.address)
            await client.close()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # never the end of membership: the next round tries again
                logger.exception("refreshing the engines failed")

    def start(self) -> None:
        if self.dynamic:
            self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
