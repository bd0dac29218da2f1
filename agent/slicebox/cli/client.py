"""A Python client for the agent's unix-socket API (standard library only).

Errors come back as the same exception tree the agent uses (``slicebox.model.errors``), chosen by
the stable code in the error envelope, so scripts can catch ``NotFound`` or check ``.code``.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

from slicebox.model import errors
from slicebox.model.paths import AGENT_SOCKET

DEFAULT_SOCKET = AGENT_SOCKET

_BY_STATUS: dict[int, type[errors.SliceboxError]] = {
    400: errors.InvalidRequest,
    403: errors.Forbidden,
    404: errors.NotFound,
    409: errors.AdmissionRefused,
    503: errors.Unavailable,
}


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError as exc:
            sock.close()
            raise errors.Unavailable(
                f"cannot connect to the agent at {self._path} ({exc.strerror}); is "
                "slicebox.socket active (systemctl status slicebox.socket) and are you in "
                "group slicebox?",
                code="agent_unreachable",
            ) from exc
        self.sock = sock


class Client:
    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float = 300.0) -> None:
        self.path = path
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            with self._open(method, path, body) as response:
                return _decode(response)
        except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            raise self._no_answer(exc) from exc

    def _no_answer(self, exc: Exception) -> errors.Unavailable:
        return errors.Unavailable(
            f"the agent at {self.path} did not answer ({exc.__class__.__name__}) within "
            f"{self.timeout:.0f}s; check `systemctl status slicebox` and its journal",
            code="agent_no_answer",
        )

    def stream(self, method: str, path: str, body: Any = None) -> Iterator[Any]:
        """Newline-delimited JSON objects, as the agent produces them."""
        try:
            with self._open(method, path, body) as response:
                if response.status >= 400:
                    _decode(response)
                for line in response:
                    if line.strip():
                        yield json.loads(line)
        except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            raise self._no_answer(exc) from exc

    def _open(self, method: str, path: str, body: Any) -> http.client.HTTPResponse:
        conn = _UnixConnection(self.path, self.timeout)
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, "/v1" + path, body=payload, headers=headers)
        return conn.getresponse()


def _decode(response: http.client.HTTPResponse) -> Any:
    raw = response.read()
    data = json.loads(raw) if raw else None
    if response.status < 400:
        return data
    envelope = data if isinstance(data, dict) else {}
    kind = _BY_STATUS.get(response.status, errors.SliceboxError)
    raise kind(
        str(envelope.get("message", f"HTTP {response.status}")),
        code=str(envelope.get("code", "http_error")),
        field=envelope.get("field"),
    )
