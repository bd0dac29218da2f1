"""The agent's resolver for egress sandboxes, on UDP port 53 of the egress bridge's address.

Each datagram is answered by ``core.egress.EgressGuard.answer`` on the event loop (the
upstream's answer is awaited, never a thread's); at most ``IN_FLIGHT`` queries at once,
further ones are dropped (the client retries, as it does for a lost datagram). The socket is
bound with ``IP_FREEBIND``: the agent listens before Docker has made the bridge, and across
the bridge's removal and making again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address
from pathlib import Path

from slicebox.host.nft import RESOLVER_PORT

log = logging.getLogger(__name__)

IN_FLIGHT = 256
UPSTREAM_TIMEOUT = 3.0
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)  # Linux's value; Python does not name it
Answer = Callable[[bytes, str], Awaitable[bytes | None]]


def resolv_conf(path: Path = Path("/etc/resolv.conf")) -> tuple[IPv4Address, ...]:
    """The IPv4 nameservers of the host's resolver configuration."""
    found: list[IPv4Address] = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ()
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                found.append(IPv4Address(parts[1]))
            except ValueError:
                continue
    return tuple(found)


class _Reply(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if not self.answer.done():
            self.answer.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


class UdpUpstream:
    """Asks the upstream servers in turn, each from a fresh socket (a fresh source port)."""

    def __init__(self, servers: tuple[IPv4Address, ...], timeout: float = UPSTREAM_TIMEOUT):
        self._servers = servers
        self._timeout = timeout

    async def ask(self, query: bytes) -> bytes:
        if not self._servers:
            raise OSError("no upstream nameserver: set [egress] upstream in the config")
        failure: Exception = OSError("no upstream answered")
        loop = asyncio.get_running_loop()
        for server in self._servers:
            transport, protocol = await loop.create_datagram_endpoint(
                _Reply, remote_addr=(str(server), RESOLVER_PORT)
            )
            try:
                transport.sendto(query)
                return await asyncio.wait_for(protocol.answer, self._timeout)
            except (OSError, TimeoutError) as exc:
                failure = exc
            finally:
                transport.close()
        raise failure


class _Serve(asyncio.DatagramProtocol):
    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self._transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self._transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if len(self._tasks) >= IN_FLIGHT:
            return
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        try:
            answer = await self._answer(data, str(addr[0]))
        except Exception:
            log.exception("resolver: a query from %s failed", addr[0])
            return
        if answer is not None and self._transport is not None:
            self._transport.sendto(answer, addr)


async def serve_resolver(
    address: IPv4Address, answer: Answer, port: int = RESOLVER_PORT
) -> Callable[[], Awaitable[None]]:
    """Listen on ``address``:``port``; returns what closes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((str(address), port))
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: _Serve(answer), sock=sock
    )
    log.info("resolver for egress sandboxes on %s:%d", address, port)

    async def close() -> None:
        transport.close()

    return close
