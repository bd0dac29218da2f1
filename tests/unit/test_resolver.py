"""The resolver's sockets (server.resolver): one query per datagram, length-prefixed messages
over TCP, and the upstream asked the way the client asked; real sockets on the loopback."""

from __future__ import annotations

import asyncio
import socket
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from slicebox.server.resolver import UdpUpstream, resolv_conf, serve_resolver

LOOPBACK = IPv4Address("127.0.0.1")


def free_port() -> int:
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        port = int(tcp.getsockname()[1])
        udp.bind(("127.0.0.1", port))
        return port


async def echo(query: bytes, source: str, tcp: bool) -> bytes | None:
    if query == b"silence":
        return None
    return (b"tcp:" if tcp else b"udp:") + source.encode() + b":" + query


def test_udp_and_tcp_queries_are_answered_and_the_upstream_asked_the_same_way() -> None:
    async def scenario() -> None:
        port = free_port()
        close = await serve_resolver(LOOPBACK, echo, port=port)
        try:
            upstream = UdpUpstream((LOOPBACK,), timeout=5, port=port)
            assert await upstream.ask(b"q1") == b"udp:127.0.0.1:q1"
            assert await upstream.ask(b"q2" * 300, tcp=True) == b"tcp:127.0.0.1:" + b"q2" * 300
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for query in (b"a", b"b"):  # two messages on one connection
                writer.write(len(query).to_bytes(2, "big") + query)
            await writer.drain()
            for query in (b"a", b"b"):
                size = int.from_bytes(await reader.readexactly(2), "big")
                assert await reader.readexactly(size) == b"tcp:127.0.0.1:" + query
            writer.write(b"\x00\x07silence")
            await writer.drain()
            assert await reader.read() == b"", "no answer: the connection is closed"
            writer.close()
        finally:
            await close()

    asyncio.run(scenario())


def test_an_upstream_that_does_not_answer_times_out() -> None:
    async def scenario() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as mute:
            mute.bind(("127.0.0.1", 0))
            upstream = UdpUpstream((LOOPBACK,), timeout=0.2, port=mute.getsockname()[1])
            with pytest.raises(TimeoutError):
                await upstream.ask(b"q")
        with pytest.raises(OSError, match="no upstream nameserver"):
            await UdpUpstream(()).ask(b"q")

    asyncio.run(scenario())


def test_the_hosts_ipv4_nameservers_are_read(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# x\nnameserver 127.0.0.53\nnameserver ::1\nnameserver bad\nsearch lan\n")
    assert resolv_conf(conf) == (IPv4Address("127.0.0.53"),)
    assert resolv_conf(tmp_path / "missing") == ()
