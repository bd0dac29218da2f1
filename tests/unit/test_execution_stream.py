"""The raw exec stream: frame decoding, the response head, and the socket pump, blocking and on
the event loop.

The decisive property (docker-py issue 3332): bytes that arrive in the same read as the
``101 Switching Protocols`` head are the start of the stream and must be decoded first.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slicebox.backends import dockerstream as execstream
from slicebox.backends.docker import DockerBackend
from slicebox.backends.dockerendpoint import DockerEndpoint
from slicebox.backends.dockerstream import (
    AsyncRawExecAttachment,
    FrameDecoder,
    split_response_head,
    start_request,
)
from slicebox.model.errors import HostError, SandboxNotFound, SandboxNotRunning, Unavailable
from slicebox.model.exec import OutputStream, StreamChunk

OUT, ERR = OutputStream.STDOUT, OutputStream.STDERR


def frame(stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxI", stream_id, len(payload)) + payload


def joined(chunks: list[StreamChunk]) -> dict[OutputStream, bytes]:
    out = {OUT: b"", ERR: b""}
    for c in chunks:
        out[c.stream] += c.data
    return out


STREAM = (
    frame(1, b"to-out\n")
    + frame(2, b"to-err\n")
    + frame(0, b"stdin")
    + frame(1, b"")
    + frame(1, bytes(range(256)))
)


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_decoder_is_exact_wherever_the_reads_split(cut: int) -> None:
    decoder = FrameDecoder()
    chunks = decoder.feed(STREAM[:cut]) + decoder.feed(STREAM[cut:])
    assert joined(chunks) == {OUT: b"to-out\n" + bytes(range(256)), ERR: b"to-err\n"}
    assert not decoder.mid_frame


def test_decoder_emits_a_large_frame_as_it_arrives() -> None:
    decoder = FrameDecoder()
    data = frame(2, b"e" * 100_000)
    first = decoder.feed(data[:1008])
    assert first == [StreamChunk(stream=ERR, data=b"e" * 1000)]
    assert decoder.mid_frame


def test_response_head_keeps_the_bytes_that_came_with_it() -> None:
    buffer = b"HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\n\r\n" + frame(1, b"hi\n")
    parsed = split_response_head(buffer)
    assert parsed is not None
    status, _, rest = parsed
    assert status == 101
    assert joined(FrameDecoder().feed(rest))[OUT] == b"hi\n"


def test_response_head_incomplete_or_garbage() -> None:
    assert split_response_head(b"HTTP/1.1 101 UPGRADED\r\nConn") is None
    with pytest.raises(HostError):
        split_response_head(b"garbage\r\n\r\n")


def test_start_request_asks_for_an_upgrade() -> None:
    text = start_request("1.45", "abc").decode()
    assert text.startswith("POST /v1.45/exec/abc/start HTTP/1.1\r\n")
    assert "Upgrade: tcp\r\n" in text
    assert text.endswith('{"Detach": false, "Tty": false}')


async def read_all(attachment: AsyncRawExecAttachment) -> list[StreamChunk]:
    chunks: list[StreamChunk] = []
    while (got := await attachment.read(1.0)) is not None:
        chunks += got
    return chunks


def test_attachment_decodes_first_bytes_then_socket_until_eof() -> None:
    async def main() -> list[StreamChunk]:
        ours, daemon = socket.socketpair()
        with daemon:
            attachment = AsyncRawExecAttachment(ours, frame(1, b"early "), b"")
            daemon.sendall(frame(1, b"late") + frame(2, b"err"))
            daemon.shutdown(socket.SHUT_WR)
            chunks = await read_all(attachment)
        attachment.close()
        return chunks

    assert joined(asyncio.run(main())) == {OUT: b"early late", ERR: b"err"}


def test_attachment_writes_all_stdin_then_half_closes() -> None:
    data = bytes(range(256)) * 2000  # more than one socket buffer

    async def main() -> tuple[bytes, list[StreamChunk]]:
        ours, daemon = socket.socketpair()
        attachment = AsyncRawExecAttachment(ours, b"", data)
        received = b""
        with daemon:
            daemon.setblocking(False)
            loop = asyncio.get_running_loop()
            while piece := await asyncio.wait_for(loop.sock_recv(daemon, 1 << 16), 5):
                received += piece
            await loop.sock_sendall(daemon, frame(1, b"done"))
            daemon.shutdown(socket.SHUT_WR)
            chunks = await read_all(attachment)
        attachment.close()
        return received, chunks

    received, chunks = asyncio.run(main())
    assert received == data
    assert joined(chunks)[OUT] == b"done"


def backend(path: str) -> DockerBackend:
    return DockerBackend(DockerEndpoint(scheme="unix", address=path), version="1.45")


def _answer_once(server: socket.socket, reply: bytes) -> threading.Thread:

    def answer() -> None:
        with server, server.accept()[0] as conn:
            request = b""
            while not request.endswith(b"}"):
                request += conn.recv(4096)
            conn.sendall(reply)

    thread = threading.Thread(target=answer)
    thread.start()
    return thread


# --- the attachment on the event loop: a stand-in daemon that speaks Docker's protocol -------

HEAD = b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker.raw-stream\r\n\r\n"
Converse = Callable[[socket.socket], None]


def serve(path: str, converse: Converse) -> threading.Thread:
    """A daemon stand-in on a unix socket: reads one exec start request, then ``converse``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def answer() -> None:
        with server, server.accept()[0] as conn:
            conn.settimeout(10)
            request = b""
            while not request.endswith(b"}"):
                request += conn.recv(4096)
            converse(conn)

    thread = threading.Thread(target=answer)
    thread.start()
    return thread


def exec_on_loop(path: str, stdin: bytes = b"") -> list[StreamChunk]:
    """Start exec e1 through the backend's async primitive and read it to its end."""

    async def main() -> list[StreamChunk]:
        attachment = await backend(path).exec_start("e1", stdin)
        chunks: list[StreamChunk] = []
        try:
            while (got := await attachment.read(1.0)) is not None:
                chunks += got
        finally:
            attachment.close()
        return chunks

    return asyncio.run(main())


def test_on_the_loop_output_sent_with_the_upgrade_response_is_not_lost(tmp_path: Path) -> None:
    """Docker writes the 101 head and the first frame in one send; both in one read here."""
    path = str(tmp_path / "docker.sock")
    thread = serve(path, lambda conn: conn.sendall(HEAD + frame(1, b"hi\n") + frame(2, b"!")))
    chunks = exec_on_loop(path)
    thread.join()
    assert joined(chunks) == {OUT: b"hi\n", ERR: b"!"}


@pytest.mark.parametrize("cut", [1, 3, 8, 9, 12, 40])
def test_on_the_loop_frames_split_across_reads_arrive_whole(tmp_path: Path, cut: int) -> None:
    path = str(tmp_path / "docker.sock")

    def dribble(conn: socket.socket) -> None:
        conn.sendall(HEAD + STREAM[:cut])  # the head with the start of the first frame
        for start in range(cut, len(STREAM), 7):
            time.sleep(0.002)  # apart, so that they arrive in reads of their own
            conn.sendall(STREAM[start : start + 7])

    thread = serve(path, dribble)
    chunks = exec_on_loop(path)
    thread.join()
    assert joined(chunks) == {OUT: b"to-out\n" + bytes(range(256)), ERR: b"to-err\n"}


def test_on_the_loop_stdin_is_delivered_whole_then_half_closed(tmp_path: Path) -> None:
    path = str(tmp_path / "docker.sock")
    data = bytes(range(256)) * 4000  # 1 MB: many writes, more than the socket buffers hold
    received = bytearray()

    def cat(conn: socket.socket) -> None:
        conn.sendall(HEAD + frame(2, b"reading\n"))
        while piece := conn.recv(65536):  # b"" only once the agent has shut its write side
            received.extend(piece)
        conn.sendall(frame(1, b"%d bytes" % len(received)))

    thread = serve(path, cat)
    chunks = exec_on_loop(path, stdin=data)
    thread.join()
    assert bytes(received) == data
    assert joined(chunks) == {OUT: b"%d bytes" % len(data), ERR: b"reading\n"}


def test_on_the_loop_the_exec_stream_works_over_plain_tcp_too() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    thread = _answer_once(server, HEAD + frame(1, b"over tcp\n"))
    endpoint = DockerEndpoint(scheme="tcp", address="127.0.0.1", port=port)

    async def main() -> list[StreamChunk]:
        attachment = await DockerBackend(endpoint, version="1.45").exec_start("e1", b"")
        chunks: list[StreamChunk] = []
        while (got := await attachment.read(1.0)) is not None:
            chunks += got
        attachment.close()
        return chunks

    chunks = asyncio.run(main())
    thread.join()
    assert joined(chunks) == {OUT: b"over tcp\n", ERR: b""}


@pytest.mark.parametrize(("status", "error"), [(404, SandboxNotFound), (409, SandboxNotRunning)])
def test_on_the_loop_start_refusals_are_mapped(
    tmp_path: Path, status: int, error: type[Exception]
) -> None:
    path = str(tmp_path / "docker.sock")
    thread = serve(path, lambda conn: conn.sendall(f"HTTP/1.1 {status} No\r\n\r\n{{}}".encode()))
    with pytest.raises(error):
        exec_on_loop(path)
    thread.join()


def test_on_the_loop_no_daemon_or_a_silent_one_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(Unavailable, match="not reachable"):
        exec_on_loop(str(tmp_path / "none.sock"))
    monkeypatch.setattr(execstream, "START_TIMEOUT", 0.2)
    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(path)
        silent.listen(1)
        with pytest.raises(Unavailable, match="in time"):
            exec_on_loop(path)


def test_on_the_loop_a_read_times_out_with_nothing_and_closing_twice_is_once() -> None:
    ours, daemon = socket.socketpair()

    async def main() -> tuple[list[StreamChunk] | None, list[StreamChunk] | None]:
        attachment = AsyncRawExecAttachment(ours, b"", b"")
        began = time.monotonic()
        quiet = await attachment.read(0.05)
        assert 0.04 <= time.monotonic() - began < 1
        attachment.close()
        attachment.close()
        return quiet, await attachment.read(0.05)

    with daemon:
        quiet, closed = asyncio.run(main())
    assert (quiet, closed) == ([], None)


def test_a_command_that_leaves_its_stdin_unread_loses_no_output(tmp_path: Path) -> None:
    """``echo`` fed a megabyte: Docker stops reading stdin when the process exits and closes the
    connection with it unread, which the kernel reports as a reset after the output, not EOF."""
    stdin = b"x" * 1_000_000

    def echo(conn: socket.socket) -> None:
        conn.sendall(HEAD + frame(1, b"hi\n"))
        time.sleep(0.05)  # the agent has filled the socket with stdin by now

    path = str(tmp_path / "docker.sock")
    thread = serve(path, echo)
    chunks = exec_on_loop(path, stdin=stdin)
    thread.join()
    assert joined(chunks) == {OUT: b"hi\n", ERR: b""}
