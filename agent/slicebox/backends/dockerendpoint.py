"""Where the Docker daemon listens, and a connection to it.

Where: ``DOCKER_HOST`` as ``unix:///path`` or ``tcp://host:port`` (plain TCP; ``http://`` is
the same), the default socket when it is unset. TLS (``https://``, ``DOCKER_TLS_VERIFY``) and the
other schemes (``ssh://``, ``fd://``) are refused with their own codes: the raw exec stream
(``backends.dockerstream``) speaks plain HTTP on its own connection, and a half-supported TLS
would fail later and less clearly.
"""

import asyncio
import contextlib
import errno
import socket
from collections.abc import Iterator, Mapping
from typing import Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import ConfigDict

from slicebox.model.base import Model
from slicebox.model.errors import Unavailable
from slicebox.model.paths import DOCKER_SOCKET

START_TIMEOUT = 120.0
CONNECT_RETRY = 0.01
DEFAULT_TCP_PORT = 2375  # Docker's plain-TCP port


class DockerEndpoint(Model):
    """Where the Docker daemon listens: a unix socket path, or a TCP host and port."""

    model_config = ConfigDict(frozen=True)

    scheme: Literal["unix", "tcp"]
    address: str  # the socket path, or the host name / IP address
    port: int = 0

    @property
    def base_url(self) -> str:
        """The URL docker-py's client takes."""
        if self.scheme == "unix":
            return f"unix://{self.address}"
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:{self.port}"

    async def connect(self) -> socket.socket:
        """A new non-blocking connection to the daemon, made on the event loop; Unavailable
        when nothing answers there. (The threads' client makes its own: ``dockerapi``.)"""
        try:
            async with asyncio.timeout(START_TIMEOUT):
                if self.scheme == "unix":
                    return await _unix_connection(self.address)
                return await _tcp_connection(self.address, self.port)
        except OSError as exc:  # TimeoutError included
            raise self.unreachable(exc) from exc

    def unreachable(self, exc: OSError) -> Unavailable:
        if exc.errno == errno.EAFNOSUPPORT and self.scheme == "tcp":
            # The agent's unit allows it unix and netlink sockets only (RestrictAddressFamilies).
            return Unavailable(
                f"the Docker daemon at {self.base_url} cannot be reached over TCP: this process "
                f"may not open TCP sockets ({exc}); for a tcp:// DOCKER_HOST give slicebox.service "
                "a drop-in with RestrictAddressFamilies=AF_INET AF_INET6, or point DOCKER_HOST "
                "at the daemon's unix socket"
            )
        return Unavailable(
            f"the Docker daemon at {self.base_url} is not reachable ({exc}); "
            "is docker.service running, and is DOCKER_HOST right?"
        )


async def _unix_connection(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    with closed_on_error(sock):
        while True:
            try:  # a unix connect completes at once, or fails: it is never in progress
                sock.connect(path)
                return sock
            except BlockingIOError:  # the daemon's accept backlog is full: it is behind
                await asyncio.sleep(CONNECT_RETRY)


async def _tcp_connection(host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    failure: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        with closed_on_error(sock):
            try:
                await loop.sock_connect(sock, address)
                return sock
            except OSError as exc:
                sock.close()
                failure = exc
    raise failure


def parse_docker_host(value: str | None) -> DockerEndpoint:
    """The endpoint a DOCKER_HOST value names (unset or empty: the default socket)."""
    if not value:
        return DockerEndpoint(scheme="unix", address=DOCKER_SOCKET)
    url = urlsplit(value)
    if url.scheme == "unix" and url.path.startswith("/"):
        return DockerEndpoint(scheme="unix", address=url.path)
    if url.scheme in ("tcp", "http") and url.hostname:
        return DockerEndpoint(scheme="tcp", address=url.hostname, port=_port(value, url))
    if url.scheme == "https":
        raise _tls_refused()
    raise Unavailable(
        f"DOCKER_HOST={value!r} is not supported; use unix:///path/to/docker.sock or "
        "tcp://host:port",
        code="docker_host_unsupported",
    )


def endpoint_from_env(env: Mapping[str, str]) -> DockerEndpoint:
    """The endpoint of DOCKER_HOST in ``env``; TLS settings are refused, not ignored."""
    if env.get("DOCKER_TLS_VERIFY") or env.get("DOCKER_TLS"):
        raise _tls_refused()
    return parse_docker_host(env.get("DOCKER_HOST"))


def _port(value: str, url: SplitResult) -> int:
    try:
        return url.port or DEFAULT_TCP_PORT
    except ValueError as exc:  # urlsplit checks the port only when it is read
        raise Unavailable(
            f"DOCKER_HOST={value!r} has no valid port; use tcp://host:port",
            code="docker_host_unsupported",
        ) from exc


def _tls_refused() -> Unavailable:
    return Unavailable(
        "Docker over TLS (https://, DOCKER_TLS_VERIFY) is not supported; point DOCKER_HOST at "
        "the daemon's unix socket, or at a plain tcp://host:port reachable only by this host",
        code="docker_tls_unsupported",
    )


@contextlib.contextmanager
def closed_on_error(sock: socket.socket) -> Iterator[None]:
    try:
        yield
    except BaseException:
        sock.close()
        raise
