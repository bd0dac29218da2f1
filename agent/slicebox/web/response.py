"""The answers handlers give: written as they are made, or sent whole.

A ``StreamResponse`` sends its head at ``prepare`` and each ``write`` returns once the socket
took the bytes (backpressure: a slow reader slows its writer, memory stays flat), chunked for
want of a length. A ``Response`` is a whole answer sent by ``prepare`` with its Content-Length.
What goes on the wire, and when, is the connection's (``web.connection``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slicebox.web.connection import Connection
    from slicebox.web.request import Request


class StreamResponse:
    """An answer written as it is made: without a Content-Length header, chunked."""

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self._conn: Connection | None = None
        self._eof = False

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: Request) -> None:
        """Send the head (once)."""
        await self._begin(request._conn)

    async def write(self, data: bytes) -> None:
        """Send ``data``; returns once the socket took it (ConnectionError: the caller left)."""
        conn = self._started()
        if data:
            await conn.send_data(data)

    async def write_eof(self) -> None:
        """End the answer (once; later calls do nothing)."""
        if not self._eof:
            if self._conn is None:
                raise RuntimeError("write_eof on a response not prepared")
            if not self._whole:
                await self._started().send_end()
            self._eof = True

    async def _begin(self, conn: Connection) -> None:
        if self._conn is None:
            payload = self._payload()
            await conn.send_head(self.status, self.headers, payload)
            self._conn = conn

    def _payload(self) -> bytes | None:
        return None

    @property
    def _whole(self) -> bool:
        return False

    def _started(self) -> Connection:
        if self._conn is None or self._eof:
            raise RuntimeError("write on a response not prepared, or ended")
        return self._conn


class Response(StreamResponse):
    """A whole answer: ``prepare`` sends it all, ``write_eof`` only marks it sent."""

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
        text: str | None = None,
    ) -> None:
        super().__init__(status, headers)
        self.body = body if text is None else text.encode()
        if not any(name.lower() == "content-type" for name in self.headers):
            self.headers["Content-Type"] = content_type

    async def write(self, data: bytes) -> None:
        raise RuntimeError("a Response is sent whole; stream with a StreamResponse")

    def _payload(self) -> bytes:
        for name in [name for name in self.headers if name.lower() == "content-length"]:
            del self.headers[name]
        self.headers["Content-Length"] = str(len(self.body))
        return self.body

    @property
    def _whole(self) -> bool:
        return True


def json_response(data: object, status: int = 200) -> Response:
    return Response(json.dumps(data).encode(), status=status)


def plain_error(status: int, reason: str) -> Response:
    """The default ``error_response``: the reason as text."""
    return Response(text=reason, status=status, content_type="text/plain; charset=utf-8")
