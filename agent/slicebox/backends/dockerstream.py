"""Docker's exec endpoints, with the attached output stream read straight off the socket.

Why not ``APIClient.exec_start``: docker-py (7.x) sends the start request through an HTTP
client, and the first bytes of output can arrive in the same read as the ``101 Switching
Protocols`` response. The HTTP client buffers them while parsing the head, and the raw socket
docker-py then hands out starts after them: those bytes are lost (docker-py issue 3332; short
commands such as ``echo hi`` hit it).

Here the start request is written on our own connection to the daemon's unix socket and the
response head is parsed by hand: every byte received after the blank line that ends the head is
the start of the multiplexed stream and goes to the frame decoder first. Nothing is buffered
anywhere else, so nothing can be lost.

The stream is Docker's multiplexed format (no TTY): frames of an 8-byte header
``[stream, 0, 0, 0, size (uint32, big-endian)]`` and ``size`` bytes of payload. The decoder emits
payloads as they arrive, even mid-frame, so memory stays bounded by one read buffer.
Stdin is written on the same connection, then the write side is shut down: Docker closes the
process's stdin at that half-close.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import struct
import time
from typing import Any

import docker
import docker.errors
import requests.exceptions

from slicebox.model.errors import HostError, SandboxNotFound, SandboxNotRunning, Unavailable
from slicebox.model.exec import ExecRequest, ExecState, OutputStream, StreamChunk
from slicebox.model.paths import DOCKER_SOCKET

log = logging.getLogger(__name__)

HEADER = struct.Struct(">BxxxI")
STREAM_IDS = {1: OutputStream.STDOUT, 2: OutputStream.STDERR}
MAX_HEAD = 64 * 1024
READ_SIZE = 64 * 1024
START_TIMEOUT = 120.0


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


def socket_path_from_host(docker_host: str | None) -> str:
    """The daemon's unix socket from a DOCKER_HOST value (None: the default socket)."""
    if not docker_host:
        return DOCKER_SOCKET
    if docker_host.startswith("unix://"):
        return docker_host[len("unix://") :]
    raise Unavailable(
        f"exec streams need the Docker daemon on a unix socket, DOCKER_HOST is {docker_host!r}"
    )


class RawExecAttachment:
    """One started exec: reads its demultiplexed output, writes its stdin."""

    def __init__(self, sock: socket.socket, first_bytes: bytes, stdin: bytes) -> None:
        self._sock = sock
        self._decoder = FrameDecoder()
        self._pending = first_bytes
        self._stdin = memoryview(stdin) if stdin else None
        self._eof = False
        sock.setblocking(False)

    def read(self, timeout: float) -> list[StreamChunk] | None:
        if self._pending:
            data, self._pending = self._pending, b""
            return self._decoder.feed(data)
        if self._eof:
            return None
        deadline = time.monotonic() + timeout
        while True:
            readable = self._wait(max(deadline - time.monotonic(), 0.0))
            if readable:
                return self._receive()
            if time.monotonic() >= deadline:
                return []

    def _wait(self, timeout: float) -> bool:
        writers = [self._sock] if self._stdin is not None else []
        readable, writable, _ = select.select([self._sock], writers, [], timeout)
        if writable:
            self._write_stdin()
        return bool(readable)

    def _receive(self) -> list[StreamChunk] | None:
        try:
            data = self._sock.recv(READ_SIZE)
        except BlockingIOError:
            return []
        if data:
            return self._decoder.feed(data)
        self._eof = True
        if self._decoder.mid_frame:
            log.warning("the exec stream ended in the middle of a frame")
        return None

    def _write_stdin(self) -> None:
        assert self._stdin is not None
        try:
            sent = self._sock.send(self._stdin[:READ_SIZE])
        except BlockingIOError:
            return
        except OSError:  # the process exited without reading all of its stdin
            sent = len(self._stdin)
        self._stdin = self._stdin[sent:]
        if not self._stdin:
            self._stdin = None
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._sock.close()


class DockerExecApi:
    """``execution.ExecApi`` on the Docker Engine API; foreign errors mapped here."""

    def __init__(self, client: docker.APIClient, socket_path: str) -> None:
        self._client = client
        self._socket_path = socket_path

    @classmethod
    def from_env(cls) -> DockerExecApi:
        path = socket_path_from_host(os.environ.get("DOCKER_HOST"))
        return cls(docker.APIClient(base_url=f"unix://{path}", version="auto"), path)

    def sandbox_pid(self, container_id: str) -> int:
        state = self._call(container_id, self._client.inspect_container, container_id)["State"]
        if not state.get("Running") or state.get("Paused"):
            raise SandboxNotRunning(
                f"sandbox {container_id} is not running ({state.get('Status')}): start it first"
            )
        return int(state["Pid"])

    def create(self, container_id: str, request: ExecRequest) -> str:
        created = self._call(
            container_id,
            self._client.exec_create,
            container_id,
            list(request.argv),
            stdin=bool(request.stdin),
            environment=dict(request.env),
            workdir=request.cwd,
        )
        return str(created["Id"])

    def start(self, exec_id: str, stdin: bytes) -> RawExecAttachment:
        sock = self._connect()
        try:
            sock.settimeout(START_TIMEOUT)  # a daemon that never answers must not hang us
            sock.sendall(start_request(self._client.api_version, exec_id))
            status, head, rest = _read_head(sock)
            if status not in (101, 200):
                raise _start_error(exec_id, status, head + b"\r\n\r\n" + rest)
        except TimeoutError as exc:
            sock.close()
            raise Unavailable(f"the Docker daemon did not start exec {exec_id} in time") from exc
        except BaseException:
            sock.close()
            raise
        return RawExecAttachment(sock, rest, stdin)

    def inspect(self, exec_id: str) -> ExecState:
        data = self._call(exec_id, self._client.exec_inspect, exec_id)
        return ExecState(
            pid=int(data.get("Pid") or 0),
            running=bool(data.get("Running")),
            exit_code=data.get("ExitCode"),
        )

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._socket_path)
        except OSError as exc:
            sock.close()
            raise Unavailable(
                f"the Docker daemon at {self._socket_path} is not reachable: {exc}"
            ) from exc
        return sock

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except docker.errors.NotFound as exc:
            raise SandboxNotFound(
                f"no sandbox {what}: check the id (it may have been destroyed)"
            ) from exc
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                raise SandboxNotRunning(
                    f"sandbox {what} is not running: {exc.explanation}"
                ) from exc
            raise HostError(f"Docker refused the exec: {exc.explanation}") from exc
        except (requests.exceptions.ConnectionError, docker.errors.DockerException) as exc:
            raise Unavailable(f"the Docker daemon is not reachable: {exc}") from exc


def _read_head(sock: socket.socket) -> tuple[int, bytes, bytes]:
    buffer = b""
    while (parsed := split_response_head(buffer)) is None:
        data = sock.recv(READ_SIZE)
        if not data or len(buffer) > MAX_HEAD:
            raise HostError("the Docker daemon closed the exec stream before answering")
        buffer += data
    return parsed


def _start_error(exec_id: str, status: int, response: bytes) -> Exception:
    text = response.decode(errors="replace")[-500:]
    if status == 404:
        return SandboxNotFound(f"exec {exec_id} or its sandbox is gone: {text}")
    if status == 409:
        return SandboxNotRunning(f"the sandbox of exec {exec_id} is not running: {text}")
    return HostError(f"Docker could not start exec {exec_id} (HTTP {status}): {text}")
