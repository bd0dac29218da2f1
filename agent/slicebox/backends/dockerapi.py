"""The Engine API calls the agent's threads make: plain HTTP/1.1 from the standard library.

Creates, starts, removals, inspects, lists and volumes run on the agent's worker threads (the
core is synchronous there). They went through docker-py's ``APIClient``, which is a requests
session over urllib3 over http.client: for every call three layers of pure Python (adapters,
hooks, cookies, retries, a pool per host), and for the process the import of all three, a
sizeable share of the agent's idle memory and of its start-up (docs/benchmarks.md). Here each
thread keeps one keep-alive ``http.client`` connection to the daemon, and a call is a request
line, a JSON body and the JSON answer.

As urllib3 does, a kept connection the daemon has closed meanwhile (readable while idle: an EOF)
is dropped before it is used, so no request is sent into a closed connection and none is
retried. What an answer means is the Docker backend's
(:func:`slicebox.backends.dockererrors.map_status`); an image's pull is read on the event loop
(:mod:`slicebox.backends.dockerpull`), and docker-py is what ``slicebox doctor`` asks.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

from slicebox.backends.dockerendpoint import DockerEndpoint, closed_on_error
from slicebox.model.errors import HostError, SliceboxError

StatusMapper = Callable[[int, str, str], SliceboxError]
Query = Mapping[str, str | int]


class _UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over the daemon's unix socket."""

    def __init__(self, endpoint: DockerEndpoint, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._endpoint = endpoint

    def connect(self) -> None:
        """A blocking connection, for this thread's calls: Unavailable when nothing answers."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with closed_on_error(sock):
                sock.connect(self._endpoint.address)
        except OSError as exc:
            raise self._endpoint.unreachable(exc) from exc
        sock.settimeout(self.timeout)
        self.sock = sock


class EngineApi:
    """JSON calls to the daemon at ``endpoint`` from any thread, each over its own connection;
    ``version`` is the API version to speak (None: the daemon's own, asked once)."""

    def __init__(
        self,
        endpoint: DockerEndpoint,
        refusal: StatusMapper,
        timeout: float,
        version: str | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._refusal = refusal
        self._timeout = timeout
        self._version = version
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()

    @property
    def version(self) -> str:
        """The API version calls use: the daemon's, asked at the first call that needs it."""
        known = self._version
        return known if known is not None else self.settle(str(self.daemon_version()["ApiVersion"]))

    def daemon_version(self) -> Any:
        """The daemon's ``/version`` answer (the one path without an API version)."""
        status, text = self.request("GET", "/version")
        return answer_json(status, text, "the version", self._refusal)

    @property
    def known_version(self) -> str | None:
        """The API version, if known already."""
        return self._version

    def settle(self, version: str) -> str:
        """Take ``version`` as the API version unless one is known; the one calls use."""
        with self._lock:
            if self._version is None:
                self._version = version
            return self._version

    def versioned(self, path: str) -> str:
        return f"/v{self.version}{path}"

    def call(
        self,
        method: str,
        path: str,
        what: str,
        *,
        query: Query | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> Any:
        """The JSON answer (None for an empty one) to ``method path`` at the API version; a
        status of 300 or more is raised as the backend maps it, about ``what``."""
        status, text = self.request(method, self.versioned(path), query=query, body=body)
        return answer_json(status, text, what, self._refusal)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Query | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> tuple[int, str]:
        """The status and text of the daemon's answer; Unavailable when it is not reachable,
        HostError when it does not answer within the timeout."""
        target = f"{path}?{urlencode(query)}" if query else path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn = self._connection()
        try:
            conn.request(method, target, body=data, headers=headers)
            answer = conn.getresponse()
            text = answer.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            self._drop(conn)
            raise call_failed(self._endpoint, exc, self._timeout) from exc
        if answer.will_close:
            self._drop(conn)
        return answer.status, text

    def close(self) -> None:
        """Close every thread's connection (the agent's shutdown)."""
        with self._lock:
            kept, self._open = self._open, set()
        for conn in kept:
            conn.close()

    def fresh(self) -> http.client.HTTPConnection:
        """A connection of its own for one streamed request (an export, an import), which the
        caller closes; the threads' kept connections stay free meanwhile."""
        return self._new_connection()

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and _dropped(conn):
            self._drop(conn)
            conn = None
        if conn is None:
            conn = self._new_connection()
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
        return conn

    def _new_connection(self) -> http.client.HTTPConnection:
        endpoint = self._endpoint
        if endpoint.scheme == "unix":
            return _UnixConnection(endpoint, self._timeout)
        return http.client.HTTPConnection(endpoint.address, endpoint.port, timeout=self._timeout)

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        with self._lock:
            self._open.discard(conn)
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept connection was closed by the daemon (readable: EOF or stray data)."""
    sock: socket.socket | None = conn.sock
    if sock is None:
        return False  # not connected yet: the request connects it
    poller = select.poll()  # not select(): the agent may hold more than 1024 descriptors
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def call_failed(endpoint: DockerEndpoint, exc: BaseException, timeout: float) -> SliceboxError:
    """A call to the daemon that got no answer: HostError when it did not answer within
    ``timeout``, else Unavailable (nothing listens, or the connection broke)."""
    if isinstance(exc, TimeoutError):
        return HostError(f"Docker did not answer within {timeout:.0f}s; is it busy?")
    if isinstance(exc, OSError):  # its errno says why (refused, no such file, no TCP)
        return endpoint.unreachable(exc)
    return endpoint.unreachable(OSError(str(exc) or type(exc).__name__))


def answer_json(status: int, text: str, what: str, refusal: StatusMapper) -> Any:
    """The daemon's answer ``text`` as JSON (None when empty); a refusal (300 and above) raised
    as ``refusal`` maps it."""
    if status >= 300:
        raise refusal(status, message_of(text), what)
    try:
        return json.loads(text) if text else None
    except ValueError as exc:
        raise HostError(f"Docker answered {what} with no JSON: {text[:200]!r}") from exc


def message_of(text: str) -> str:
    """The daemon's error message out of its JSON answer ({"message": ...}), else the text."""
    try:
        said = json.loads(text)
    except ValueError:
        return text.strip()
    return str(said.get("message", text)) if isinstance(said, dict) else text.strip()
