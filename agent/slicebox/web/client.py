"""A keep-alive HTTP/1.1 client over asyncio streams, for Docker's socket and the agent's.

The agent makes several small JSON calls to Docker for every exec, and its async Python client
makes many to the agent: a connection per call would cost a connect and a server task each.
``HttpClient`` keeps up to ``limit`` connections to one endpoint and hands out the one put back
last (the least likely to have been closed by the server's idle timeout). A server may still
have closed it while it sat idle: an answer that ends before its first byte on a reused
connection is sent once more on a new one, when the request can be sent again (its body is
bytes, not a stream that was consumed).

A server that refuses a large upload without reading it closes the connection under the
upload, and the write may fail before its answer is read: ``Expect: 100-continue`` makes the
body wait for the server's go, so the refusal is heard.

An answer's body stays on the socket until it is read, through ``content`` or
``read``/``iter_any``, in whichever task; only the event loop is shared. Read it, ``release``
it or ``close`` it: until then its connection is not free for another request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from typing import Self

from slicebox.web.message import (
    LAST_CHUNK,
    READ_SIZE,
    BodyReader,
    Headers,
    chunk,
    format_head,
    framing,
    is_bodiless,
    parse_headers,
    parse_status_line,
    read_head,
    says_close,
)

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
Body = bytes | AsyncIterable[bytes] | Iterable[bytes] | None
Start = tuple[tuple[int, int], int, str]  # an answer's version, status and reason
_FRAMING = ("content-length", "transfer-encoding")  # the client sets these from the body


class _NoAnswer(ConnectionResetError):
    """The server closed the connection before any byte of an answer."""


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def stale(self) -> bool:
        """Closed by either side (an EOF the loop has seen, at least)."""
        return self.writer.is_closing() or self.reader.at_eof()

    async def send(self, *data: bytes, timeout: float | None) -> bool:
        """Write ``data`` and wait until the socket took it; False when the server is gone
        (it may have answered already: a refused upload is answered before it is read)."""
        if self.writer.is_closing():
            return False
        for piece in data:
            self.writer.write(piece)
        try:
            async with asyncio.timeout(timeout):
                await self.writer.drain()
        except ConnectionError:
            return False
        return True


class ClientResponse:
    """An answer's head; its body (``content``) still on the connection."""

    def __init__(
        self,
        pool: HttpClient,
        conn: _Conn,
        start: Start,
        headers: Headers,
        content: BodyReader,
        *,
        reusable: bool,
    ) -> None:
        self.version, self.status, self.reason = start
        self.headers = headers
        self.content = content
        self._pool = pool
        self._conn: _Conn | None = conn
        self._reusable = reusable
        self._body: bytes | None = None

    async def read(self) -> bytes:
        """The whole body; the connection then goes back to the pool."""
        if self._body is None:
            try:
                self._body = await self.content.readall()
            except BaseException:
                self.close()
                raise
            self.release()
        return self._body

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive; back to the pool once it ended."""
        try:
            while piece := await self.content.read(READ_SIZE):
                yield piece
        except BaseException:  # GeneratorExit included: a body left unread cannot be reused
            self.close()
            raise
        self.release()

    def release(self) -> None:
        """Back to the pool when the body was read to its end, else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._put_back(conn, self._reusable and self.content.done)

    def close(self) -> None:
        """Drop the connection (a stream ended early: the server sees its client gone)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._put_back(conn, False)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        # An answer dropped unread would hold its connection, and its place under the limit,
        # for as long as the pool lives.
        if self._conn is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: so is the socket
                self.close()


class HttpClient:
    """A pool of keep-alive connections made by ``connect``; at most ``limit`` open at once."""

    def __init__(self, connect: Connect, *, host: str = "localhost", limit: int = 16) -> None:
        self._connect = connect
        self._host = host
        self._limit = limit
        self._idle: list[_Conn] = []  # the last put back is the first reused
        self._open = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    @classmethod
    def unix(cls, path: str, *, limit: int = 16) -> HttpClient:
        return cls(lambda: asyncio.open_unix_connection(path), limit=limit)

    @classmethod
    def tcp(cls, host: str, port: int, *, limit: int = 16) -> HttpClient:
        return cls(lambda: asyncio.open_connection(host, port), host=f"{host}:{port}", limit=limit)

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: Body = None,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
    ) -> ClientResponse:
        """Send a request and wait for its answer's head.

        A bytes ``body`` goes with its Content-Length, an iterable one chunked as it comes.
        With ``Expect: 100-continue`` in ``headers`` the body waits for the server's 100: a
        server that refuses a large body unread (413) is then heard, where otherwise the
        write to its closed connection may fail first (ConnectionResetError).
        ``read_timeout`` bounds each wait on the socket, for the answer and for each read of
        its body (TimeoutError). A failure to connect is the OSError of ``connect``; an answer
        that is not HTTP, a ProtocolError."""
        head = self._head(method, target, body, headers)
        expect = any(
            name.lower() == "expect" and value.lower() == "100-continue"
            for name, value in (headers or {}).items()
        )
        conn, reused = await self._checkout(fresh=False, timeout=connect_timeout)
        try:
            return await self._exchange(conn, method, head, body, read_timeout, expect=expect)
        except _NoAnswer:
            if not reused or not (body is None or isinstance(body, bytes | bytearray)):
                raise
        # The server closed the kept connection while it sat idle (its keep-alive timeout, a
        # restart): the request most likely never reached it.
        conn, _ = await self._checkout(fresh=True, timeout=connect_timeout)
        return await self._exchange(conn, method, head, body, read_timeout, expect=expect)

    async def close(self) -> None:
        """Close the idle connections; later requests are a RuntimeError."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._drop(conn)
        self._wake()  # a request waiting for a connection fails now
        await asyncio.gather(*(conn.writer.wait_closed() for conn in idle), return_exceptions=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _head(
        self, method: str, target: str, body: Body, headers: Mapping[str, str] | None
    ) -> bytes:
        if not target.startswith("/") or any(c in target for c in " \r\n"):
            raise ValueError(f"a request target is a path and query: {target!r}")
        given = dict(headers or {})
        fields = [] if any(name.lower() == "host" for name in given) else [("Host", self._host)]
        fields += [(name, value) for name, value in given.items() if name.lower() not in _FRAMING]
        if isinstance(body, bytes | bytearray):
            fields.append(("Content-Length", str(len(body))))
        elif body is not None:
            fields.append(("Transfer-Encoding", "chunked"))
        return format_head(f"{method.upper()} {target} HTTP/1.1", fields)

    async def _exchange(
        self,
        conn: _Conn,
        method: str,
        head: bytes,
        body: Body,
        timeout: float | None,
        *,
        expect: bool,
    ) -> ClientResponse:
        try:
            if expect and body is not None:
                refused = await self._before_body(conn, method, head, timeout)
                if refused is not None:
                    return refused
                head = b""
            whole = await self._send(conn, head, body, timeout)
            start, headers = await self._final_head(conn, timeout, until_continue=False)
            return self._response(conn, method, start, headers, timeout, reusable=whole)
        except BaseException:
            self._put_back(conn, False)
            raise

    async def _before_body(
        self, conn: _Conn, method: str, head: bytes, timeout: float | None
    ) -> ClientResponse | None:
        """Send the head alone and wait: None on 100 Continue, else the server's answer."""
        if not await conn.send(head, timeout=timeout):
            raise _NoAnswer("the server closed the connection before the request's head went")
        start, headers = await self._final_head(conn, timeout, until_continue=True)
        if start[1] == 100:
            return None
        return self._response(conn, method, start, headers, timeout, reusable=False)

    async def _send(self, conn: _Conn, head: bytes, body: Body, timeout: float | None) -> bool:
        """Send the request; whether all of it went (the server may stop reading to answer)."""
        if body is None or isinstance(body, bytes | bytearray):
            if body and len(body) > 16 * 1024:  # a large body goes uncopied
                return await conn.send(head, body, timeout=timeout)
            return await conn.send(head + (body or b""), timeout=timeout)
        if not await conn.send(head, timeout=timeout):
            return False
        async with contextlib.aclosing(_pieces(body)) as pieces:
            async for piece in pieces:
                if piece and not await conn.send(chunk(piece), timeout=timeout):
                    return False
        return await conn.send(LAST_CHUNK, timeout=timeout)

    async def _final_head(
        self, conn: _Conn, timeout: float | None, *, until_continue: bool
    ) -> tuple[Start, Headers]:
        """The final answer's status line and headers, interim 1xx answers skipped (but a
        100 Continue ``until_continue``)."""
        while True:
            async with asyncio.timeout(timeout):
                lines = await read_head(conn.reader)
            if lines is None:
                raise _NoAnswer("the server closed the connection without an answer")
            start = parse_status_line(lines[0])
            if start[1] == 100 and until_continue:
                return start, Headers()
            if not 100 <= start[1] < 200 or start[1] == 101:
                return start, parse_headers(lines[1:])

    def _response(
        self,
        conn: _Conn,
        method: str,
        start: Start,
        headers: Headers,
        timeout: float | None,
        *,
        reusable: bool,
    ) -> ClientResponse:
        """The answer with its body framed as its head says."""
        length, chunked = framing(headers)
        if method.upper() == "HEAD" or (is_bodiless(start[1]) and start[1] != 101):
            length, chunked = 0, False
        until_eof = length is None and not chunked  # the body ends with the connection
        reusable = reusable and start[0] >= (1, 1) and not says_close(headers) and not until_eof
        content = BodyReader(
            conn.reader, length=length, chunked=chunked, until_eof=until_eof, timeout=timeout
        )
        response = ClientResponse(self, conn, start, headers, content, reusable=reusable)
        if content.done:  # nothing to read: nobody has to, to free the connection
            response.release()
        return response

    async def _checkout(self, fresh: bool, timeout: float | None) -> tuple[_Conn, bool]:
        """A connection for one request, and whether it was reused: an idle one unless
        ``fresh``, else a new one while fewer than ``limit`` are open, else wait for one."""
        while True:
            if self._closed:
                raise RuntimeError("the HTTP client is closed")
            conn = None if fresh else self._reuse()
            if conn is not None:
                return conn, True
            if self._open >= self._limit and self._idle:
                self._drop(self._idle.pop(0))  # room for a new one
            if self._open < self._limit:
                return await self._dial(timeout), False
            await self._wait()

    def _reuse(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn
            self._drop(conn)
        return None

    async def _dial(self, timeout: float | None) -> _Conn:
        self._open += 1
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await self._connect()
        except BaseException:
            self._open -= 1
            self._wake()
            raise
        return _Conn(reader, writer)

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        """Every waiter looks again (few wait; one of them gets what changed)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _put_back(self, conn: _Conn, reusable: bool) -> None:
        if reusable and not self._closed and not conn.stale():
            self._idle.append(conn)
            self._wake()
        else:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        conn.writer.transport.abort()
        self._open -= 1
        self._wake()


async def _pieces(body: AsyncIterable[bytes] | Iterable[bytes]) -> AsyncGenerator[bytes, None]:
    if isinstance(body, AsyncIterable):
        async for piece in body:
            yield piece
    else:
        for piece in body:
            yield piece
