"""The agent's HTTP/1.1 server on a unix socket: the subset of ``aiohttp.web`` its handlers use.

Handlers, middlewares, typed app state and the response classes keep aiohttp's meaning, so the
agent's routes ported one to one: routing happens inside the middlewares (a middleware answers
404 and 405 like any error), a handler is never cancelled because its caller left (it finds
out when it writes), and a ``StreamResponse`` writes with backpressure (each write waits until
the socket took the last). What is gone is what the agent never used: TCP sites, TLS, HEAD,
websockets, access logs, and most of aiohttp's resident memory.

One task per connection serves its requests one after the other. A request body nobody read
is drained only when it is small (64 KiB) and was asked for; otherwise the answer says
``Connection: close`` and, when the client may still be sending, the connection lingers
(answer sent, writing shut, the rest read away and dropped) so the refusal is heard.
``100 Continue`` goes out only when a handler first reads the body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast
from urllib.parse import parse_qsl, unquote

from slicebox.web.message import (
    LAST_CHUNK,
    READ_SIZE,
    BodyReader,
    BodyTooLarge,
    Headers,
    ProtocolError,
    chunk,
    format_head,
    framing,
    is_bodiless,
    parse_headers,
    parse_request_line,
    phrase,
    read_head,
    says_close,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

Handler = Callable[["Request"], Awaitable["StreamResponse"]]
Middleware = Callable[["Request", Handler], Awaitable["StreamResponse"]]
ErrorResponse = Callable[[int, str], "StreamResponse"]
Cleanup = Callable[["Application"], Awaitable[None]]

DRAIN_MAX = 64 * 1024  # an unread request body up to this is read away to keep the connection
SMALL_BODY = 16 * 1024  # a body this small goes out in one write with its head
CLOSE_WAIT = 5.0  # for a closing connection to flush; a client that does not read is cut
LINGER_TIME, LINGER_IDLE = 30.0, 5.0  # a refused body read away, at most so long (nginx's)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class AppKey(Generic[T]):
    """A typed key of an ``Application``'s state: ``app[key]`` is a ``kind``."""

    __slots__ = ("kind", "name")

    def __init__(self, name: str, kind: type[T]) -> None:
        self.name = name
        self.kind = kind

    def __repr__(self) -> str:
        return f"<AppKey {self.name}>"


class HTTPError(Exception):
    """An answer of ``status``; raised by routing (404, 405) and by ``Request.read`` (413)."""

    def __init__(self, status: int, reason: str | None = None) -> None:
        self.status = status
        self.reason = reason or phrase(status)
        super().__init__(f"{status} {self.reason}")


class Router:
    """Path patterns of literal segments and ``{name}`` segments (one non-empty segment)."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, list[str], Handler]] = []

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        if not path.startswith("/"):
            raise ValueError(f"a route's path starts with /: {path!r}")
        self._routes.append((method.upper(), path.split("/")[1:], handler))

    def add_get(self, path: str, handler: Handler) -> None:
        self.add_route("GET", path, handler)

    def resolve(self, method: str, raw_path: str) -> tuple[Handler, dict[str, str]]:
        """The handler of ``method`` on ``raw_path`` and what its pattern matched; else
        HTTPError 405 (the path is served, not that method) or 404."""
        segments = [unquote(segment) for segment in raw_path.split("/")[1:]]
        served = False
        for verb, pattern, handler in self._routes:
            matched = _match(pattern, segments)
            if matched is not None and verb == method:
                return handler, matched
            served = served or matched is not None
        raise HTTPError(405 if served else 404)


def _match(pattern: list[str], segments: list[str]) -> dict[str, str] | None:
    if len(pattern) != len(segments):
        return None
    matched = {}
    for part, segment in zip(pattern, segments, strict=True):
        if part.startswith("{") and part.endswith("}") and segment:
            matched[part[1:-1]] = segment
        elif part != segment:
            return None
    return matched


class Application:
    """Routes, the middlewares around them, typed state, and what runs when serving stops.

    ``error_response`` builds the answers the server itself gives: to a request it cannot
    read as HTTP, and to an HTTPError no middleware answered."""

    def __init__(
        self,
        middlewares: Sequence[Middleware] = (),
        client_max_size: int = 1024 * 1024,
        error_response: ErrorResponse | None = None,
    ) -> None:
        self.router = Router()
        self.on_cleanup: list[Cleanup] = []
        self.client_max_size = client_max_size
        self.error_response: ErrorResponse = error_response or plain_error
        self._middlewares = tuple(middlewares)
        self._state: dict[AppKey[Any], object] = {}
        self._chain: Handler | None = None

    def __getitem__(self, key: AppKey[T]) -> T:
        return cast(T, self._state[key])

    def __setitem__(self, key: AppKey[T], value: T) -> None:
        self._state[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def get(self, key: AppKey[T], default: T) -> T:
        return cast(T, self._state.get(key, default))

    async def handle(self, request: Request) -> StreamResponse:
        """``request`` through the middlewares (the first outermost) to its route."""
        if self._chain is None:
            self._chain = self._route
            for middleware in reversed(self._middlewares):
                self._chain = _through(middleware, self._chain)
        return await self._chain(request)

    async def _route(self, request: Request) -> StreamResponse:
        handler, request.match_info = self.router.resolve(request.method, request._target_path)
        return await handler(request)


def _through(middleware: Middleware, inner: Handler) -> Handler:
    async def handler(request: Request) -> StreamResponse:
        return await middleware(request, inner)

    return handler


class Request:
    """One request: its head parsed, its body still on the socket (``content``)."""

    def __init__(
        self,
        app: Application,
        conn: _Connection,
        head: tuple[str, str, tuple[int, int]],
        headers: Headers,
        content: BodyReader,
    ) -> None:
        self.method, self.raw_path, self.version = head
        self._target_path, _, query = self.raw_path.partition("?")  # as sent, for routing
        self.path = unquote(self._target_path)
        self.query = dict(parse_qsl(query, keep_blank_values=True))
        self.headers = headers
        self.content = content
        self.app = app
        self.match_info: dict[str, str] = {}
        self.client_max_size = app.client_max_size
        self._conn = conn
        self._state: dict[Hashable, Any] = {}
        self._body: bytes | None = None

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        """The connection's transport (its socket for SO_PEERCRED; ``close()`` cuts it)."""
        return self._conn.transport

    @property
    def content_length(self) -> int | None:
        return self.content.length

    def __getitem__(self, key: Hashable) -> Any:
        return self._state[key]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._state[key] = value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._state

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; HTTPError 413 over ``limit`` (``client_max_size`` by default)."""
        if self._body is None:
            try:
                limit = self.client_max_size if limit is None else limit
                self._body = await self.content.readall(limit)
            except BodyTooLarge as exc:
                raise HTTPError(413) from exc
        return self._body


class StreamResponse:
    """An answer written as it is made: without a Content-Length header, chunked."""

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self._conn: _Connection | None = None
        self._chunked = False
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
            await conn.send(chunk(data) if self._chunked else data)

    async def write_eof(self) -> None:
        """End the answer (once; later calls do nothing)."""
        if not self._eof:
            if self._chunked:
                await self._started().send(LAST_CHUNK)
            elif self._conn is None:
                raise RuntimeError("write_eof on a response not prepared")
            self._eof = True

    async def _begin(self, conn: _Connection) -> None:
        if self._conn is None:
            self._conn = conn
            self._chunked = await conn.send_head(self.status, self.headers, self._payload())

    def _payload(self) -> bytes:
        return b""

    def _started(self) -> _Connection:
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


def json_response(data: object, status: int = 200) -> Response:
    return Response(json.dumps(data).encode(), status=status)


def plain_error(status: int, reason: str) -> Response:
    """The default ``error_response``: the reason as text."""
    return Response(text=reason, status=status, content_type="text/plain; charset=utf-8")


@dataclass
class _Exchange:
    """Where one request and its answer stand on their connection."""

    version: tuple[int, int] = (1, 1)
    keep_alive: bool = False
    body: BodyReader | None = None
    expect: bool = False  # the client waits for 100 Continue before it sends the body
    continued: bool = False
    answered: bool = False  # the answer's head went out


class _Connection:
    """One client's connection: its requests one after the other, while it keeps it."""

    def __init__(
        self, serving: Serving, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._serving = serving
        self._reader, self._writer = reader, writer
        self.transport = writer.transport
        self.busy = False  # in the middle of a request, not waiting for the next
        self._now = _Exchange()

    async def run(self) -> None:
        try:
            while await self._exchange():
                self.busy = False
        except asyncio.CancelledError:
            self.transport.abort()
            raise
        except ConnectionError:
            pass  # the client went away, maybe in the middle of a body
        except Exception:
            log.exception("HTTP connection failed")
        finally:
            await self._close()

    async def _exchange(self) -> bool:
        """One request and its answer; whether the connection stays for another."""
        try:
            lines = await self._next_head()
            if lines is None:
                return False
            self.busy = True
            request = self._request(lines)
        except ProtocolError as exc:
            self.busy = True
            await self._refuse(exc)
            return False
        response = await self._answer(request)
        if response is None:
            return False
        if not response.prepared:
            await self._send_whole(response)
        elif not response._eof:
            return False  # a stream that did not end: the client sees it cut
        return await self._reusable()

    async def _next_head(self) -> list[bytes] | None:
        if self._serving.closing:
            return None
        try:
            async with asyncio.timeout(self._serving.keepalive_timeout):
                return await read_head(self._reader)
        except TimeoutError:
            return None  # idle too long

    def _request(self, lines: list[bytes]) -> Request:
        head = parse_request_line(lines[0])
        headers = parse_headers(lines[1:])
        length, chunked = framing(headers)
        modern = head[2] >= (1, 1)  # HTTP/1.0 has neither keep-alive by default nor 100
        self._now = _Exchange(version=head[2], keep_alive=modern and not says_close(headers))
        self._now.expect = modern and headers.get("expect", "").lower() == "100-continue"
        hook = self._continue if self._now.expect else None
        body = BodyReader(self._reader, length=length, chunked=chunked, before_first_read=hook)
        self._now.body = body
        return Request(self._serving.app, self, head, headers, body)

    async def _continue(self) -> None:
        if not self._now.answered:  # after the answer's head a 100 would be out of order
            self._now.continued = True
            await self.send(_CONTINUE)

    async def _answer(self, request: Request) -> StreamResponse | None:
        """The app's answer, or an error answer; None when nothing more can be sent."""
        app = self._serving.app
        try:
            return await app.handle(request)
        except HTTPError as exc:
            return None if self._now.answered else app.error_response(exc.status, exc.reason)
        except ProtocolError as exc:  # the body's framing broke: where the next request starts is
            self._now.keep_alive = False  # unknown, and the fault is the client's, not a crash
            return None if self._now.answered else app.error_response(exc.status, str(exc))
        except ConnectionError as exc:  # the client's, most likely: gone in the middle of a body
            log.info("%s %s ended by a broken connection: %s", request.method, request.path, exc)
            return None if self._now.answered else app.error_response(500, phrase(500))
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            return None if self._now.answered else app.error_response(500, phrase(500))

    async def _send_whole(self, response: StreamResponse) -> None:
        try:
            await response._begin(self)
        except ValueError:  # a header that would break the head: nothing of it went out
            log.exception("an answer with a malformed header")
            response = self._serving.app.error_response(500, phrase(500))
            await response._begin(self)
        await response.write_eof()

    async def _refuse(self, exc: ProtocolError) -> None:
        """Answer a request that is not HTTP, then close: where it ends is unknown."""
        self._now = _Exchange()
        await self._send_whole(self._serving.app.error_response(exc.status, str(exc)))

    async def _reusable(self) -> bool:
        """Whether the answered connection can take another request: the client keeps it and
        what is left of the request body is little and on its way (it is read away)."""
        body = self._now.body
        if not self._now.keep_alive or self._serving.closing or self.transport.is_closing():
            return False
        if body is None or body.done:
            return True
        try:
            async with asyncio.timeout(self._serving.keepalive_timeout):
                return await body.discard(DRAIN_MAX)
        except (ProtocolError, TimeoutError):
            return False

    async def send_head(self, status: int, headers: Mapping[str, str], payload: bytes) -> bool:
        """Send the answer's head (and a whole body, ``payload``); whether it is chunked."""
        if self._now.answered:
            raise RuntimeError("this request has its answer already")
        head, chunked = self._head(status, headers)
        self._now.answered = True
        if len(payload) <= SMALL_BODY:
            await self.send(head + payload)
        else:  # no copy of a large body
            self._writer.write(head)
            await self.send(payload)
        return chunked

    def _head(self, status: int, headers: Mapping[str, str]) -> tuple[bytes, bool]:
        """The answer's head with the server's framing; whether its body is chunked."""
        names = {name.lower() for name in headers}
        bodiless = is_bodiless(status)
        sized = "content-length" in names or bodiless
        chunked = not sized and self._now.version >= (1, 1)
        self._now.keep_alive = self._keeps(headers, framed=sized or chunked)
        drop = {"transfer-encoding", "connection"} | ({"content-length"} if bodiless else set())
        fields = [(name, value) for name, value in headers.items() if name.lower() not in drop]
        if "content-type" not in names and not bodiless:
            fields.append(("Content-Type", "application/octet-stream"))
        if chunked:
            fields.append(("Transfer-Encoding", "chunked"))
        if not self._now.keep_alive:
            fields.append(("Connection", "close"))
        return format_head(f"HTTP/1.1 {status} {phrase(status)}", fields), chunked

    def _keeps(self, headers: Mapping[str, str], framed: bool) -> bool:
        """Whether the connection stays after this answer: its end is framed (not the
        connection's close), nobody says close, and the rest of the request body can go."""
        wanted = self._now.keep_alive and not says_close(headers) and not self._serving.closing
        if not (wanted and framed) or self._now.body is None or self._now.body.done:
            return wanted and framed
        if self._now.expect and not self._now.continued:
            return False  # the client holds the body back until told
        left = self._now.body.remaining
        return left is None or left <= DRAIN_MAX

    async def send(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the connection to the client is closed")
        self._writer.write(data)
        await self._writer.drain()

    async def _close(self) -> None:
        if self._still_sending():
            await self._linger()
        self._writer.close()
        try:
            async with asyncio.timeout(CLOSE_WAIT):
                await self._writer.wait_closed()
        except OSError:  # a reset, or a client that does not read what is left to flush
            self.transport.abort()

    def _still_sending(self) -> bool:
        """Whether the client may still be sending a body its answer refused."""
        body, now = self._now.body, self._now
        if body is None or body.done or not now.answered or self.transport.is_closing():
            return False
        return not now.expect or now.continued

    async def _linger(self) -> None:
        """Close the way a refused upload's answer is heard: stop writing (the client reads
        the answer, then the end), and read away what it still sends for a while. Closed at
        once, the kernel resets the connection under the client's write, and a client whose
        write fails first (asyncio's does: it closes the socket) loses the answer it was sent."""
        try:
            self._writer.write_eof()
            async with asyncio.timeout(LINGER_TIME):
                while True:
                    async with asyncio.timeout(LINGER_IDLE):
                        if not await self._reader.read(READ_SIZE):
                            return
        except (OSError, TimeoutError):
            pass  # a reset, or a client that sends on and on: it is cut


class Serving:
    """An application answering on a listening socket, until ``close``."""

    def __init__(self, app: Application, keepalive_timeout: float) -> None:
        self.app = app
        self.keepalive_timeout = keepalive_timeout
        self.closing = False
        self._server: asyncio.Server | None = None
        self._open: dict[_Connection, asyncio.Task[None]] = {}
        self._closed = asyncio.Event()

    @property
    def connections(self) -> int:
        """The connections open now."""
        return len(self._open)

    async def close(self, timeout: float = 30.0) -> None:
        """Stop accepting; close idle connections now and the others once answered (or cut
        after ``timeout``); then run the app's ``on_cleanup``. Once; later calls wait for it."""
        if self.closing:
            await self._closed.wait()
            return
        self.closing = True
        try:
            if self._server is not None:
                self._server.close()
            for conn, task in list(self._open.items()):
                if not conn.busy:
                    task.cancel()
            await self._finish(timeout)
            if self._server is not None:
                await self._server.wait_closed()
            for callback in self.app.on_cleanup:
                await callback(self.app)
        finally:
            self._closed.set()

    async def _listen(self, *, sock: socket.socket | None = None, path: str | None = None) -> None:
        if sock is not None:
            # Not start_unix_server: from Python 3.13 on it unlinks the socket's file at close,
            # a passed socket's included, and systemd's socket unit would be left listening on
            # a file that is gone (the next agent started on it unreachable).
            self._server = await asyncio.start_server(self._accept, sock=sock)
        else:
            self._server = await asyncio.start_unix_server(self._accept, path=path)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, reader, writer)
        task = asyncio.get_running_loop().create_task(conn.run())
        self._open[conn] = task
        task.add_done_callback(lambda _: self._open.pop(conn, None))

    async def _finish(self, timeout: float) -> None:
        tasks = list(self._open.values())
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=timeout)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(
    app: Application, sock: socket.socket, *, keepalive_timeout: float = 75.0
) -> Serving:
    """Serve ``app`` on ``sock``, a bound and listening unix socket (systemd's, say)."""
    serving = Serving(app, keepalive_timeout)
    await serving._listen(sock=sock)
    return serving


async def serve_path(app: Application, path: str, *, keepalive_timeout: float = 75.0) -> Serving:
    """Serve ``app`` on a new unix socket at ``path``."""
    serving = Serving(app, keepalive_timeout)
    await serving._listen(path=path)
    return serving
