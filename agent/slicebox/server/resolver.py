"""The agent's resolver for egress sandboxes, on port 53 (UDP and TCP) of the egress bridge's
address.

Each datagram is answered by ``core.egress.EgressGuard.answer`` on the event loop (the
upstream's answer is awaited, never a thread's); at most ``IN_FLIGHT`` queries at once, further
ones are dropped (the client retries, as it does for a lost datagram), and so are those past
their sandbox's rate (the ``Gate``'s ``admitted``), before any task is made for them. An
answer too long for a datagram comes back truncated, as the upstream sent it, and the client
asks again over TCP, which is asked upstream over TCP. A TCP connection the ``Gate`` refuses
(too many from one sandbox, or in all: each holds a descriptor) is closed at once. The
sockets are bound with ``IP_FREEBIND``: the agent listens before Docker has made the bridge,
and across the bridge's removal and making again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Protocol, cast

from slicebox.host.nft import RESOLVER_PORT

log = logging.getLogger(__name__)

IN_FLIGHT = 256
UPSTREAM_TIMEOUT = 3.0
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)  # Linux's value; Python does not name it
TCP_IDLE = 10.0  # a TCP client silent this long is let go
Answer = Callable[[bytes, str, bool], Awaitable[bytes | None]]  # (query, source, over TCP)


class Gate(Protocol):
    """Whose query is answered, who may hold a TCP connection (``core.egress.EgressGuard``)."""

    def admitted(self, source: str) -> bool: ...

    def connected(self, source: str) -> bool: ...

    def disconnected(self, source: str) -> None: ...


class _Open:
    def admitted(self, source: str) -> bool:
        return True

    def connected(self, source: str) -> bool:
        return True

    def disconnected(self, source: str) -> None:
        return None


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

    def __init__(
        self,
        servers: tuple[IPv4Address, ...],
        timeout: float = UPSTREAM_TIMEOUT,
        port: int = RESOLVER_PORT,
    ) -> None:
        self._servers = servers
        self._timeout = timeout
        self._port = port

    async def ask(self, query: bytes, *, tcp: bool = False) -> bytes:
        if not self._servers:
            raise OSError("no upstream nameserver: set [egress] upstream in the config")
        failure: Exception = OSError("no upstream answered")
        for server in self._servers:
            try:
                ask = _ask_tcp if tcp else _ask_udp
                return await asyncio.wait_for(ask(str(server), self._port, query), self._timeout)
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                failure = exc
        raise failure


async def _ask_udp(server: str, port: int, query: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(_Reply, remote_addr=(server, port))
    try:
        transport.sendto(query)
        return await protocol.answer
    finally:
        transport.close()


async def _ask_tcp(server: str, port: int, query: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(server, port)
    try:
        writer.write(len(query).to_bytes(2, "big") + query)
        await writer.drain()
        return await _message(reader)
    finally:
        writer.close()


async def _message(reader: asyncio.StreamReader) -> bytes:
    """One length-prefixed DNS message of a TCP stream."""
    size = int.from_bytes(await reader.readexactly(2), "big")
    return await reader.readexactly(size)


class _Serve(asyncio.DatagramProtocol):
    def __init__(self, answer: Answer, gate: Gate) -> None:
        self._answer, self._gate = answer, gate
        self._transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if len(self._tasks) >= IN_FLIGHT or not self._gate.admitted(str(addr[0])):
            return
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        try:
            answer = await self._answer(data, str(addr[0]), False)
        except Exception:
            log.exception("resolver: a query from %s failed", addr[0])
            return
        if answer is not None and self._transport is not None:
            self._transport.sendto(answer, addr)


async def serve_resolver(
    address: IPv4Address, answer: Answer, port: int = RESOLVER_PORT, gate: Gate | None = None
) -> Callable[[], Awaitable[None]]:
    """Listen on ``address``:``port``, UDP and TCP; returns what closes both."""
    gate = gate or _Open()
    admit: Gate = gate
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: _Serve(answer, admit), sock=_bound(socket.SOCK_DGRAM, address, port)
    )

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername")[0])
        if not gate.connected(peer):
            writer.transport.abort()  # no goodbye owed: the descriptor goes now
            return
        try:
            while True:
                query = await asyncio.wait_for(_message(reader), TCP_IDLE)
                if not gate.admitted(peer):
                    continue
                reply = await answer(query, peer, True)
                if reply is None:
                    break
                writer.write(len(reply).to_bytes(2, "big") + reply)
                await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            gate.disconnected(peer)
            writer.close()

    tcp = _bound(socket.SOCK_STREAM, address, port)
    tcp.listen(64)
    server = await asyncio.start_server(client, sock=tcp)
    log.info("resolver for egress sandboxes on %s:%d", address, port)

    async def close() -> None:
        transport.close()
        server.close()
        await server.wait_closed()

    return close


def _bound(kind: socket.SocketKind, address: IPv4Address, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((str(address), port))
    sock.setblocking(False)
    return sock
