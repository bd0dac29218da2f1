"""Exec streams read off the Docker daemon's socket (where it is: ``backends.dockerendpoint``).

Why the exec stream is not ``APIClient.exec_start``: docker-py (7.x) sends the start request
through an HTTP client, and the first bytes of output can arrive in the same read as the
``101 Switching Protocols`` response. The HTTP client buffers them while parsing the head, and
the raw socket docker-py then hands out starts after them: those bytes are lost (docker-py
issue 3332; short commands such as ``echo hi`` hit it).

Here the start request is written on our own connection to the daemon (unix or TCP) and the
response head is parsed by hand: every byte received after the blank line that ends the head is
the start of the multiplexed stream and goes to the frame decoder first. Nothing is buffered
anywhere else, so nothing can be lost.

The stream is Docker's multiplexed format (no TTY): frames of an 8-byte header
``[stream, 0, 0, 0, size (uint32, big-endian)]`` and ``size`` bytes of payload. The decoder emits
payloads as they arrive, even mid-frame, so memory stays bounded by one read buffer.
Stdin is written on the same connection, then the write side is shut down: Docker closes the
process's stdin at that half-close.

The attachment (``AsyncRawExecAttachment``) waits on the event loop, which says when the socket
is readable or writable (``add_reader``/``add_writer``), so an exec that runs for an hour holds
no thread. It reads the raw socket itself rather than through an asyncio transport and stream
reader: a transport that fails to write stdin (the command exited without reading it) closes its
read side too, and output still in the kernel's buffer would be lost; here a failed stdin write
only ends the stdin. A wait that times out or is cancelled has read nothing, so it loses nothing
either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct

from slicebox.backends.base import StdinSource
from slicebox.backends.dockerendpoint import START_TIMEOUT, DockerEndpoint, closed_on_error
from slicebox.model.errors import HostError, Unavailable
from slicebox.model.exec import OutputStream, StreamChunk

log = logging.getLogger(__name__)

HEADER = struct.Struct(">BxxxI")
STREAM_IDS = {1: OutputStream.STDOUT, 2: OutputStream.STDERR}
MAX_HEAD = 64 * 1024
READ_SIZE = 64 * 1024


class FrameDecoder:
    """Incremental decoder of Docker's multiplexed stream; payloads come out as they arrive."""

    def __init__(self) -> None:
        self._header = b""
        self._stream: OutputStream | None = None
        self._left = 0

    def feed(self, data: bytes) -> list[StreamChunk]:
        chunks: list[StreamChunk] = []
        view = memoryview(data)
        while view:
            if self._left == 0:
                view = self._take_header(view)
                continue
            piece, view = view[: self._left], view[self._left :]
            self._left -= len(piece)
            if self._stream is not None:  # stdin echo (id 0) or unknown ids are skipped
                chunks.append(StreamChunk(stream=self._stream, data=bytes(piece)))
        return chunks

    def _take_header(self, view: memoryview) -> memoryview:
        need = HEADER.size - len(self._header)
        self._header += bytes(view[:need])
        if len(self._header) == HEADER.size:
            stream_id, self._left = HEADER.unpack(self._header)
            self._stream = STREAM_IDS.get(stream_id)
            self._header = b""
        return view[need:]

    @property
    def mid_frame(self) -> bool:
        return bool(self._header) or self._left > 0


def split_response_head(buffer: bytes) -> tuple[int, bytes, bytes] | None:
    """(status, head, rest) once ``buffer`` holds the whole HTTP response head, else None."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head, rest = buffer[:end], buffer[end + 4 :]
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        raise HostError(f"the Docker daemon sent an unreadable response: {status_line!r}")
    return int(status_line[1]), head, rest


def start_request(api_version: str, exec_id: str) -> bytes:
    body = json.dumps({"Detach": False, "Tty": False}).encode()
    head = (
        f"POST /v{api_version}/exec/{exec_id}/start HTTP/1.1\r\n"
        "Host: docker\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
    )
    return head.encode() + body


def attach_request(api_version: str, container_id: str) -> bytes:
    """An attach to a running container's stdin, stdout and stderr, as a raw stream."""
    query = "stream=1&stdin=1&stdout=1&stderr=1"
    return (
        f"POST /v{api_version}/containers/{container_id}/attach?{query} HTTP/1.1\r\n"
        "Host: docker\r\nContent-Length: 0\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
    ).encode()


class _ExecSocket:
    """One started exec's connection, non-blocking: decodes what is received, writes stdin in
    pieces and half-closes after it."""

    def __init__(self, sock: socket.socket, first_bytes: bytes, stdin: bytes) -> None:
        self._sock = sock
        self._decoder = FrameDecoder()
        self._pending = first_bytes  # what came with the response head: decoded first
        self._stdin = memoryview(stdin) if stdin else None
        self._eof = False
        sock.setblocking(False)

    def _receive(self) -> list[StreamChunk] | None:
        try:
            data = self._sock.recv(READ_SIZE)
        except BlockingIOError:
            return []
        except ConnectionResetError:
            # The daemon closed the connection with stdin of ours unread (the command exited
            # without reading it all): the kernel says so after the output, in place of EOF.
            data = b""
        if data:
            return self._decoder.feed(data)
        self._eof = True
        if self._decoder.mid_frame:
            log.warning("the exec stream ended in the middle of a frame")
        return None

    def _write_stdin(self) -> None:
        assert self._stdin is not None
        sent = self._send(self._stdin[:READ_SIZE])
        if sent is None:  # the process exited without reading all of its stdin
            sent = len(self._stdin)
        self._stdin = self._stdin[sent:]
        if not self._stdin:
            self._stdin = None
            self._half_close()

    def _send(self, data: memoryview) -> int | None:
        """How much of ``data`` the socket took (0: none now); None once the command has
        stopped reading its stdin."""
        try:
            return self._sock.send(data[:READ_SIZE])
        except BlockingIOError:
            return 0
        except OSError:
            return None

    def _half_close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)


class AsyncRawExecAttachment(_ExecSocket):
    """One started exec on the running event loop: the loop wakes the read when the socket is
    readable, and writes stdin whenever it is writable, whether or not anyone reads.

    A streamed stdin (:class:`~slicebox.backends.base.StdinSource`) is fed by a task of its own:
    it asks the source for the next chunk only once the socket has taken the last one, so what
    the agent holds of it is one chunk, whatever its size. When the source fails (an upload over
    its cap, a sender gone), the next read raises its error; the command stopping its reading
    ends the feeding quietly, as for bytes.
    """

    def __init__(self, sock: socket.socket, first_bytes: bytes, stdin: bytes | StdinSource) -> None:
        super().__init__(sock, first_bytes, stdin if isinstance(stdin, bytes) else b"")
        self._loop = asyncio.get_running_loop()
        self._fd: int | None = sock.fileno()
        self._feeder: asyncio.Task[None] | None = None
        if not isinstance(stdin, bytes):
            self._feeder = self._loop.create_task(self._feed(stdin))
        elif self._stdin is not None:
            self._loop.add_writer(self._fd, self._stdin_writable)

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if self._pending:
            data, self._pending = self._pending, b""
            return self._decoder.feed(data)
        fd = self._fd
        if self._eof or fd is None:
            return None
        readable = self._loop.create_future()
        self._loop.add_reader(fd, _wake, readable)
        try:
            woken = {readable} if self._feeder is None else {readable, self._feeder}
            await asyncio.wait(woken, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._loop.remove_reader(fd)
        self._raise_stdin_failure()
        # The bytes are taken only now: a wait given up lost none.
        return self._receive() if readable.done() else []

    def _raise_stdin_failure(self) -> None:
        feeder = self._feeder
        if feeder is None or not feeder.done():
            return
        self._feeder = None
        if not feeder.cancelled() and (error := feeder.exception()) is not None:
            raise error

    async def _feed(self, source: StdinSource) -> None:
        while chunk := await source.read():
            view = memoryview(chunk)
            while view:
                if not await self._writable():
                    return
                if (sent := self._send(view)) is None:
                    return  # the command exited without reading all of its stdin
                view = view[sent:]
        self._half_close()

    async def _writable(self) -> bool:
        fd = self._fd
        if fd is None:
            return False
        ready = self._loop.create_future()
        self._loop.add_writer(fd, _wake, ready)
        try:
            await ready
        finally:
            if self._fd is not None:  # else close() removed it: the number may be reused
                self._loop.remove_writer(fd)
        return True

    def _stdin_writable(self) -> None:
        self._write_stdin()
        if self._stdin is None and self._fd is not None:
            self._loop.remove_writer(self._fd)

    def close(self) -> None:
        """Once: the descriptor's number may belong to another socket of the loop after."""
        fd, self._fd = self._fd, None
        if self._feeder is not None:
            self._feeder.cancel()
        if fd is not None:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)
        self._sock.close()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _read_head(sock: socket.socket) -> tuple[int, bytes, bytes]:
    loop, buffer = asyncio.get_running_loop(), b""
    while (parsed := split_response_head(buffer)) is None:
        buffer = _more_head(buffer, await loop.sock_recv(sock, READ_SIZE))
    return parsed


def _more_head(buffer: bytes, data: bytes) -> bytes:
    if not data or len(buffer) > MAX_HEAD:
        raise HostError("the Docker daemon closed the exec stream before answering")
    return buffer + data


class StartRefused(Exception):
    """The daemon answered an exec start with an HTTP error (mapped by the backend)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


async def release(
    endpoint: DockerEndpoint, api_version: str, container_id: str, line: bytes
) -> None:
    """Attach to ``container_id``'s stdin only, on a new connection to ``endpoint``, write
    ``line`` and hang up: with ``StdinOnce`` Docker then closes the process's stdin once it
    read what was written."""
    query = "stream=1&stdin=1"
    request = (
        f"POST /v{api_version}/containers/{container_id}/attach?{query} HTTP/1.1\r\n"
        "Host: docker\r\nContent-Length: 0\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    sock = await endpoint.connect()
    with sock:
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await loop.sock_sendall(sock, request)
                status, head, rest = await _read_head(sock)
                _check_started(status, head, rest)
                await loop.sock_sendall(sock, line)
        except TimeoutError as exc:
            raise _not_started(container_id) from exc
        sock.shutdown(socket.SHUT_WR)  # the end of stdin: Docker reads up to it


async def attach(
    endpoint: DockerEndpoint,
    api_version: str,
    exec_id: str,
    stdin: bytes | StdinSource,
    *,
    request: bytes | None = None,
) -> AsyncRawExecAttachment:
    """Start exec ``exec_id`` on a new connection to ``endpoint`` and return its attachment:
    the head parsed by hand, every byte after it the start of the stream; StartRefused, or
    Unavailable when the daemon does not answer.
    ``request``: another request whose answer is such a stream (``attach_request``: then
    ``exec_id`` is the container's id)."""
    loop = asyncio.get_running_loop()
    sock = await endpoint.connect()
    with closed_on_error(sock):
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await loop.sock_sendall(sock, request or start_request(api_version, exec_id))
                status, head, rest = await _read_head(sock)
        except TimeoutError as exc:
            raise _not_started(exec_id) from exc
        _check_started(status, head, rest)
        return AsyncRawExecAttachment(sock, rest, stdin)


def _check_started(status: int, head: bytes, rest: bytes) -> None:
    if status not in (101, 200):
        text = (head + b"\r\n\r\n" + rest).decode(errors="replace")[-500:]
        raise StartRefused(status, text)


def _not_started(exec_id: str) -> Unavailable:
    return Unavailable(f"the Docker daemon did not start exec {exec_id} in time")
