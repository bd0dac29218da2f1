"""A streamed stdin on the exec socket: pulled from its source only as the socket takes it.

The property that keeps the agent's memory flat whatever an upload's size: with nobody reading
the other end, the attachment asks its source for a few socket buffers' worth and then waits;
once the other end reads, every byte arrives, in order, followed by the half-close.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator

import pytest

from slicebox.backends.dockerstream import AsyncRawExecAttachment
from slicebox.model.errors import TooLarge

PIECE = 64 * 1024
PIECES = 400  # 25 MiB: far more than any socket buffer


class Counted:
    """A source of ``PIECES`` distinct pieces that counts how many were asked for."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.pulled = 0
        self.sent = hashlib.sha256()
        self._fail_at = fail_at

    async def read(self) -> bytes:
        if self.pulled == self._fail_at:
            raise TooLarge("over the cap")
        if self.pulled == PIECES:
            return b""
        piece = self.pulled.to_bytes(4, "big") * (PIECE // 4)
        self.pulled += 1
        self.sent.update(piece)
        return piece


async def _drain(sock: socket.socket) -> tuple[str, int]:
    loop, received, size = asyncio.get_running_loop(), hashlib.sha256(), 0
    while data := await loop.sock_recv(sock, PIECE):
        received.update(data)
        size += len(data)
    return received.hexdigest(), size


async def _read_to_the_end(attachment: AsyncRawExecAttachment) -> None:
    while await attachment.read(1.0) is not None:
        pass


@contextlib.asynccontextmanager
async def attached(source: Counted) -> AsyncIterator[tuple[AsyncRawExecAttachment, socket.socket]]:
    """An attachment feeding ``source`` to one end of a socket pair; the other end is Docker's."""
    ours, daemon = socket.socketpair()
    daemon.setblocking(False)
    attachment = AsyncRawExecAttachment(ours, b"", source)
    try:
        yield attachment, daemon
    finally:
        attachment.close()
        daemon.close()


def test_a_streamed_stdin_waits_for_the_socket_then_arrives_whole() -> None:
    async def scenario() -> None:
        source = Counted()
        async with attached(source) as (attachment, daemon):
            for _ in range(20):  # the engine reading output meanwhile; nothing comes
                assert await attachment.read(0.01) == []
            held = source.pulled
            buffers = attachment_buffers(daemon)
            assert held * PIECE <= buffers + 2 * PIECE, "pulled more than the socket took"
            assert held < PIECES
            digest, size = await _drain(daemon)  # ends at the half-close
            assert (digest, size) == (source.sent.hexdigest(), PIECES * PIECE)

    asyncio.run(scenario())


def attachment_buffers(daemon: socket.socket) -> int:
    """What the pair can hold in flight: its send and receive buffers (the same on each end)."""
    send = daemon.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return send + daemon.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def test_a_failing_source_ends_the_next_read_with_its_error() -> None:
    async def scenario() -> None:
        async with attached(Counted(fail_at=3)) as (attachment, daemon):
            drained = asyncio.ensure_future(_drain(daemon))
            with pytest.raises(TooLarge):
                await _read_to_the_end(attachment)
        drained.cancel()

    asyncio.run(scenario())


def test_a_command_that_stops_reading_ends_the_feeding_quietly() -> None:
    async def scenario() -> None:
        source = Counted()
        async with attached(source) as (attachment, daemon):
            daemon.close()  # the command exited; Docker closed its side
            while (chunks := await attachment.read(0.05)) is not None:
                assert chunks == []
        assert source.pulled < PIECES

    asyncio.run(scenario())
