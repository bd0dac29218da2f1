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
import contextlib
import errno
import json
import logging
import os
import re
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import h11

from slicebox.web.limits import Gate, Limits, QuietLog
from slicebox.web.message import (
    MAX_HEAD_BYTES,
    READ_SIZE,
    BodyCutOff,
    BodyTooLarge,
    Headers,
    ProtocolError,
    is_bodiless,
    is_token,
    phrase,
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
BACKLOG = 1024  # a socket bound here (systemd's socket unit sets its own)


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
        if any("/" in segment or "\x00" in segment for segment in segments):
            raise HTTPError(400, "a path segment holds an encoded / (%2F) or NUL; name it plainly")
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
        content: Content,
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
        """The whole body; HTTPError 413 over ``limit`` (``client_max_size`` by default), 429
        when the body memory budget is full, 408 when it does not come in time, 400 when its
        framing is malformed or the client left in the middle of it."""
        if self._body is None:
            try:
                limit = self.client_max_size if limit is None else limit
                self._body = await self.content.readall(limit)
            except BodyTooLarge as exc:
                raise HTTPError(413) from exc
            except (BodyStalled, TimeoutError) as exc:
                raise HTTPError(
                    408, "the request body did not arrive in time; send it whole"
                ) from exc
            except BodyCutOff as exc:
                raise HTTPError(400, f"the request body was cut off ({exc})") from exc
            except ProtocolError as exc:
                raise HTTPError(exc.status, str(exc)) from exc
        return self._body


class StreamResponse:
    """An answer written as it is made: without a Content-Length header, chunked."""

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self._conn: _Connection | None = None
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

    async def _begin(self, conn: _Connection) -> None:
        if self._conn is None:
            payload = self._payload()
            await conn.send_head(self.status, self.headers, payload)
            self._conn = conn

    def _payload(self) -> bytes | None:
        return None

    @property
    def _whole(self) -> bool:
        return False

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

    @property
    def _whole(self) -> bool:
        return True


def json_response(data: object, status: int = 200) -> Response:
    return Response(json.dumps(data).encode(), status=status)


def plain_error(status: int, reason: str) -> Response:
    """The default ``error_response``: the reason as text."""
    return Response(text=reason, status=status, content_type="text/plain; charset=utf-8")


class Content:
    """A request's body as it comes off the connection (h11 frames it): ``read`` hands out
    what arrived, at most ``n`` bytes, never holding more than one read's worth; ``readall``
    the whole of it, within the time and memory bounds of ``Limits``."""

    def __init__(self, conn: _Connection, length: int | None, chunked: bool, expect: bool) -> None:
        self._conn = conn
        self._length = length
        self._left: int | None = None if chunked else (length or 0)
        self._ended = False  # h11 gave the body's end
        self._pending = b""
        self._expect = expect  # 100 Continue is due before the first wait for bytes
        self.timeout: float | None = conn.limits.body_idle  # each wait for bytes

    @property
    def done(self) -> bool:
        """The whole body has been consumed."""
        return self._ended or (self._left == 0 and not self._pending)

    @property
    def length(self) -> int | None:
        """The Content-Length, when the body has one."""
        return self._length

    @property
    def remaining(self) -> int | None:
        """Bytes of a Content-Length body not yet read; None when chunked."""
        return self._left

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes, as soon as any are there (``n=-1``: the whole rest); b"" at the
        end of the body. BodyCutOff when the client leaves or sends nothing for ``timeout``."""
        if n < 0:
            return await self.readall()
        if n == 0:
            return b""
        if not self._pending:
            if self._ended:
                return b""
            if self._expect:
                self._expect = False
                await self._conn.continue_()
            self._pending = await self._conn.body_data(self.timeout)
            if not self._pending:
                self._ended = True
                return b""
        piece, self._pending = self._pending[:n], self._pending[n:]
        if self._left is not None:
            self._left -= len(piece)
        return piece

    async def readall(self, limit: int | None = None) -> bytes:
        """The rest of the body, held under the body memory budget (HTTPError 429 when the
        caller's share or the agent's is full) and within ``body_timeout`` (TimeoutError);
        BodyTooLarge, before reading, when its length says it is over ``limit``, or as soon
        as more than ``limit`` bytes came."""
        if limit is not None and self._length is not None and self._length > limit:
            raise BodyTooLarge(limit)
        if self._length:
            self._conn.hold_body(self._length)
        pieces: list[bytes] = []
        size = 0
        async with asyncio.timeout(self._conn.limits.body_timeout):
            while piece := await self.read(READ_SIZE):
                size += len(piece)
                if limit is not None and size > limit:
                    raise BodyTooLarge(limit)
                if self._length is None:  # chunked: held as it comes
                    self._conn.hold_body(len(piece))
                pieces.append(piece)
        return b"".join(pieces)


class BodyStalled(BodyCutOff):
    """The client sent nothing of a body for longer than the server waits."""


class _Exchange:
    """Where one request and its answer stand on their connection."""

    def __init__(
        self, *, body: Content | None = None, expect: bool = False, refused: bool = False
    ) -> None:
        self.body = body
        self.expect = expect  # the client waits for 100 Continue before it sends the body
        self.continued = False
        self.answered = False  # the answer's head went out
        self.broken = False  # the body's framing broke, or the client left: no next request
        self.refused = refused  # refused before a handler: the client may still be sending
        self.counted = False  # counted in the requests in flight
        self.held = 0  # body bytes counted against the body budget


_METHOD = re.compile(rb"[A-Z]+")
_BAD_FIELD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # what an answer's field never carries
MAX_LENGTH_DIGITS = 18  # a Content-Length of up to 999 PB; h11 0.16 takes 20, 0.14 any
_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
ACCEPT_RETRY = 0.1  # seconds between two accepts while descriptors are out
_PEERCRED = struct.Struct("3i")


def _strict_h11() -> None:
    """Where h11 is lenient for compatibility, be strict (the socket is a trust boundary):
    no whitespace after a chunk size and no control bytes in a chunk extension, and no
    obs-fold continuation lines (RFC 9112 5.2 lets a server refuse them: it does, 400)."""
    readers: Any = getattr(h11, "_readers")  # noqa: B009 (private: checked, and tested)
    assert hasattr(readers, "chunk_header_re"), "h11 changed: see _strict_h11"
    assert hasattr(readers, "obs_fold_re"), "h11 changed: see _strict_h11"
    readers.chunk_header_re = re.compile(
        rb"(?P<chunk_size>[0-9A-Fa-f]{1,15})(?P<chunk_ext>;[\t\x20-\x7e]*)?\r\n"
    )
    readers.obs_fold_re = re.compile(rb"(?!)")  # matches nothing: a folded line is malformed


_strict_h11()


def _status_of(exc: h11.ProtocolError) -> int:
    """The status a malformed request is answered with: h11's hint, but 400 for a transfer
    coding h11 does not take (a repeated or listed Transfer-Encoding is a smuggling attempt
    more likely than an honest client, RFC 9112 6.3)."""
    status = exc.error_status_hint
    return 400 if status == 501 else status


def _origin_form(target: str) -> str:
    if target.startswith("/"):
        return target
    if "://" in target:  # absolute-form, which a server must accept too (RFC 9112 3.2.2)
        split = urlsplit(target)
        return (split.path or "/") + (f"?{split.query}" if split.query else "")
    raise ProtocolError(f"malformed request target {target[:100]!r}")


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (None: not known)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except (OSError, AttributeError):
        return None
    uid: int = _PEERCRED.unpack(raw)[1]
    return uid


class _Connection:
    """One client's connection: its requests one after the other, while it keeps it. h11
    parses and frames; this moves the bytes, with time limits, and counts what is held."""

    def __init__(
        self, serving: Serving, sock: socket.socket, uid: int | None, triage: bool
    ) -> None:
        self._serving = serving
        self.limits = serving.limits
        self.uid = uid
        self.triage = triage  # over a connection cap: one head read, health or a refusal
        self._sock: socket.socket | None = sock
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.transport: asyncio.Transport | None = None
        self.busy = False  # in the middle of a request, not waiting for the next
        self._eof = False
        self._now = _Exchange()

    async def run(self) -> None:
        sock, self._sock = self._sock, None
        assert sock is not None
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        self.transport = cast(asyncio.Transport, self._writer.transport)
        try:
            while await self._exchange():
                self.busy = False
        except asyncio.CancelledError:
            self.transport.abort()
            raise
        except (ConnectionError, TimeoutError):
            pass  # the client went away, or stopped reading, maybe in the middle of a body
        except Exception:
            log.exception("HTTP connection failed")
        finally:
            await self._close()

    async def _exchange(self) -> bool:
        """One request and its answer; whether the connection stays for another."""
        try:
            request = await self._next_request()
        except ProtocolError as exc:
            self.busy = True
            await self._refuse(exc)
            return False
        if request is None:
            return False
        try:
            response = await self._answer(request)
            if response is None:
                return False
            if not response.prepared:
                await self._send_whole(response)
            elif not response._eof:
                return False  # a stream that did not end: the client sees it cut
            return await self._reusable()
        finally:
            self._release()

    async def _next_request(self) -> Request | None:
        """The next request's head, parsed; None when the client leaves or idles past the
        keep-alive time. A head must be whole within ``head_timeout`` of its first byte."""
        if self._serving.closing:
            return None
        idle = self.limits.triage_timeout if self.triage else self._serving.keepalive_timeout
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                if self._eof:
                    return None  # closed in the middle of a head: nobody to answer
                raise ProtocolError(str(exc), _status_of(exc)) from exc
            except ValueError as exc:  # h11 before 0.16 int()s a Content-Length of any length
                raise ProtocolError(f"malformed request head ({exc})") from None
            if isinstance(event, h11.Request):
                return self._request(event)
            if event is not h11.NEED_DATA:
                return None  # the client closed its end
            buffered = len(self._h11.trailing_data[0])
            if deadline is None and buffered:
                deadline = loop.time() + self.limits.head_timeout
                self.busy = True
            # Never more than one byte past the head's bound: h11 checks it while a head is
            # incomplete only, and a read that ends a head far past it would pass unseen.
            room = max(1, MAX_HEAD_BYTES + 1 - buffered)
            try:
                await self._receive(idle if deadline is None else deadline - loop.time(), room)
            except TimeoutError:
                if deadline is None:
                    return None  # idle too long
                raise ProtocolError(
                    f"the request head did not arrive whole within {self.limits.head_timeout:g} s",
                    408,
                ) from None
            except ConnectionError:
                return None

    async def _receive(self, timeout: float | None, at_most: int = READ_SIZE) -> None:
        assert self._reader is not None
        if self._eof:
            raise BodyCutOff("the connection is closed")
        async with asyncio.timeout(timeout):
            data = await self._reader.read(min(at_most, READ_SIZE))
        self._eof = not data
        self._h11.receive_data(data)

    def _request(self, event: h11.Request) -> Request:
        self.busy = True
        if event.http_version not in (b"1.0", b"1.1"):
            raise ProtocolError(f"HTTP/{event.http_version.decode()} is not spoken here", 505)
        if not _METHOD.fullmatch(event.method):
            raise ProtocolError(f"malformed method {event.method[:20]!r}: methods are upper case")
        pairs = []
        for name, value in event.headers:
            if not value.isascii():
                raise ProtocolError(f"the {name.decode()} header has bytes outside ASCII")
            pairs.append((name.decode(), value.decode()))
        headers = Headers(pairs)
        target = _origin_form(event.target.decode("ascii"))
        chunked = "transfer-encoding" in headers
        if chunked and "content-length" in headers:  # RFC 9112 6.1: a smuggling attempt
            raise ProtocolError("both Content-Length and Transfer-Encoding")
        if len(headers.get("content-length", "")) > MAX_LENGTH_DIGITS:
            raise ProtocolError("malformed Content-Length: more digits than any body here has")
        length = (
            None if chunked or "content-length" not in headers else int(headers["content-length"])
        )
        expect = self._h11.they_are_waiting_for_100_continue
        body = Content(self, length, chunked, expect)
        self._now = _Exchange(body=body, expect=expect)
        version = (1, int(event.http_version[2:]))
        return Request(
            self._serving.app, self, (event.method.decode(), target, version), headers, body
        )

    async def continue_(self) -> None:
        """Tell a client waiting for it to send the body (once, before the answer)."""
        if self._now.expect and not self._now.answered and not self._now.continued:
            self._now.continued = True
            await self._write(
                [
                    self._h11.send(
                        h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                    )
                ]
            )

    async def body_data(self, timeout: float | None) -> bytes:
        """The next bytes of the body that arrived; b"" at its end."""
        try:
            return await self._body_data(timeout)
        except (ProtocolError, BodyCutOff):
            self._now.broken = True
            raise

    async def _body_data(self, timeout: float | None) -> bytes:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                if self._eof:
                    raise BodyCutOff("the connection closed before the body's end") from exc
                raise ProtocolError(str(exc), _status_of(exc)) from exc
            if isinstance(event, h11.Data):
                return bytes(event.data)
            if isinstance(event, h11.EndOfMessage):
                return b""
            if event is not h11.NEED_DATA:
                raise BodyCutOff(f"the body ended by {type(event).__name__}")
            try:
                await self._receive(timeout)
            except TimeoutError as exc:
                raise BodyStalled(f"the client sent nothing of the body for {timeout:g} s") from exc
            except ConnectionError as exc:  # a reset is a cut-off as well as an EOF is
                raise BodyCutOff(f"the connection broke before the body's end ({exc})") from exc

    def hold_body(self, size: int) -> None:
        """Count ``size`` bytes of this request's body against the body memory budget;
        HTTPError 429 when the caller's share or the whole is full."""
        why = self._serving.bodies.take(self.uid, size)
        if why is not None:
            raise HTTPError(429, self._serving.refused(self.uid, "request body memory", why))
        self._now.held += size

    def _release(self) -> None:
        now = self._now
        if now.held:
            self._serving.bodies.give(self.uid, now.held)
            now.held = 0
        if now.counted:
            self._serving.in_flight.give(self.uid)
            now.counted = False

    def _admitted(self, request: Request) -> StreamResponse | None:
        """None when ``request`` may go on; else its refusal (a cap is full)."""
        if (request.method, request._target_path) in self.limits.always:
            return None
        if self.triage:
            reason = self._serving.refused(self.uid, "connections", self._serving.full_of(self.uid))
        else:
            why = self._serving.in_flight.take(self.uid)
            if why is None:
                self._now.counted = True
                return None
            reason = self._serving.refused(self.uid, "requests in flight", why)
        return self._serving.app.error_response(429, reason)

    async def _answer(self, request: Request) -> StreamResponse | None:
        """The app's answer, or an error answer; None when nothing more can be sent."""
        app = self._serving.app
        refusal = self._admitted(request)
        if refusal is not None:
            return refusal
        try:
            return await app.handle(request)
        except HTTPError as exc:
            return None if self._now.answered else app.error_response(exc.status, exc.reason)
        except ProtocolError as exc:  # the body's framing broke: where the next request starts is
            self._now.broken = True  # unknown, and the fault is the client's, not a crash
            return None if self._now.answered else app.error_response(exc.status, str(exc))
        except ConnectionError as exc:  # the client's, most likely: gone in the middle of a body
            log.info("%s %s ended by a broken connection: %s", request.method, request.path, exc)
            self._now.broken = True
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
        self._now = _Exchange(refused=True)
        if self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        await self._send_whole(self._serving.app.error_response(exc.status, str(exc)))

    async def _reusable(self) -> bool:
        """Whether the answered connection can take another request: h11 says both sides are
        done once what is left of the request body (little, on its way) is read away."""
        if self._h11.our_state is not h11.DONE or self._serving.closing or self._now.broken:
            return False
        assert self.transport is not None
        if self.transport.is_closing():
            return False
        body = self._now.body
        if body is not None and self._h11.their_state is h11.SEND_BODY:
            await self._read_away(body)
        if self._h11.their_state is not h11.DONE:
            return False
        self._h11.start_next_cycle()
        return True

    async def _read_away(self, body: Content) -> None:
        """Read the rest of an unread body that is small and on its way (h11 then says the
        request is done); leave a larger or slower one be."""
        left = body.remaining
        if left is not None and left > DRAIN_MAX:
            return
        try:
            async with asyncio.timeout(self._serving.keepalive_timeout):
                at_most = DRAIN_MAX
                while piece := await body.read(READ_SIZE):
                    at_most -= len(piece)
                    if at_most < 0:
                        return
        except (ProtocolError, TimeoutError, ConnectionError):
            return

    async def send_head(
        self, status: int, headers: Mapping[str, str], payload: bytes | None
    ) -> None:
        """Send the answer's head, and with ``payload`` the whole answer."""
        if self._now.answered:
            raise RuntimeError("this request has its answer already")
        fields = self._fields(status, headers)
        self._now.answered = True
        pieces = [
            self._h11.send(h11.Response(status_code=status, headers=fields, reason=phrase(status)))
        ]
        if payload is not None:
            if payload and not is_bodiless(status):
                pieces.extend(self._h11.send_with_data_passthrough(h11.Data(data=payload)) or ())
            pieces.append(self._h11.send(h11.EndOfMessage()))
        await self._write([piece for piece in pieces if piece])

    async def send_data(self, data: bytes) -> None:
        await self._write(self._h11.send_with_data_passthrough(h11.Data(data=data)) or [])

    async def send_end(self) -> None:
        await self._write([self._h11.send(h11.EndOfMessage()) or b""])

    def _fields(self, status: int, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        """The answer's fields, the server's framing left to h11; a field that would break
        the head is a ValueError (nothing of the answer went out)."""
        names = {name.lower() for name in headers}
        bodiless = is_bodiless(status)
        drop = {"transfer-encoding", "connection"} | ({"content-length"} if bodiless else set())
        fields = [(name, value) for name, value in headers.items() if name.lower() not in drop]
        for name, value in fields:
            if not is_token(name.encode()) or _BAD_FIELD.search(value):
                raise ValueError(f"a malformed field {name!r} in an answer of {status}")
        if "content-type" not in names and not bodiless:
            fields.append(("Content-Type", "application/octet-stream"))
        if status == 429 and "retry-after" not in names:
            fields.append(("Retry-After", str(self.limits.retry_after)))
        if not self._keeps(headers):
            fields.append(("Connection", "close"))
        return fields

    def _keeps(self, headers: Mapping[str, str]) -> bool:
        """Whether the connection may stay after this answer: nobody says close, and the
        rest of the request body can be read away."""
        now = self._now
        if says_close(headers) or self._serving.closing or self.triage or now.broken or now.refused:
            return False
        if now.body is None or now.body.done:
            return True
        if now.expect and not now.continued:
            return False  # the client holds the body back until told
        left = now.body.remaining
        return left is None or left <= DRAIN_MAX

    async def _write(self, pieces: list[bytes]) -> None:
        """Send ``pieces``; returns once the socket took them. A client that takes nothing
        for ``write_stall`` seconds is cut (ConnectionResetError); a slow one is waited for."""
        assert self._writer is not None
        assert self.transport is not None
        if self.transport.is_closing():
            raise ConnectionResetError("the connection to the client is closed")
        self._writer.writelines(pieces)
        transport = self.transport
        while True:
            before = transport.get_write_buffer_size()
            try:
                async with asyncio.timeout(self.limits.write_stall):
                    await self._writer.drain()
                return
            except TimeoutError:
                if transport.get_write_buffer_size() < before:
                    continue  # it reads, slowly
                transport.abort()
                raise ConnectionResetError(
                    f"the client read nothing of its answer for {self.limits.write_stall:g} s"
                ) from None

    async def _close(self) -> None:
        assert self._writer is not None
        assert self.transport is not None
        if self._still_sending():
            await self._linger()
        self._writer.close()
        try:
            async with asyncio.timeout(CLOSE_WAIT):
                await self._writer.wait_closed()
        except (OSError, TimeoutError):  # a reset, or a client that does not read what is left
            self.transport.abort()

    def _still_sending(self) -> bool:
        """Whether the client may still be sending a body its answer refused."""
        assert self.transport is not None
        now = self._now
        if self.transport.is_closing() or self._eof:
            return False
        if now.refused:
            return True
        if now.body is None or now.body.done or now.broken or not now.answered:
            return False
        return not now.expect or now.continued

    async def _linger(self) -> None:
        """Close the way a refused upload's answer is heard: stop writing (the client reads
        the answer, then the end), and read away what it still sends for a while. Closed at
        once, the kernel resets the connection under the client's write, and a client whose
        write fails first (asyncio's does: it closes the socket) loses the answer it was sent."""
        assert self._writer is not None
        assert self._reader is not None
        brief = self.triage or self._now.refused
        total, idle = (self.limits.triage_timeout,) * 2 if brief else (LINGER_TIME, LINGER_IDLE)
        try:
            self._writer.write_eof()
            async with asyncio.timeout(total):
                while True:
                    async with asyncio.timeout(idle):
                        if not await self._reader.read(READ_SIZE):
                            return
        except (OSError, TimeoutError):
            pass  # a reset, or a client that sends on and on: it is cut


class Serving:
    """An application answering on a listening socket, until ``close``: it accepts, and
    holds each uid to ``limits``."""

    def __init__(self, app: Application, keepalive_timeout: float, limits: Limits) -> None:
        self.app = app
        self.keepalive_timeout = keepalive_timeout
        self.limits = limits
        self.closing = False
        exempt = limits.exempt_uids
        self.open = Gate(limits.connections_per_uid, limits.connections, exempt)
        self.over = Gate(limits.triage_per_uid, limits.triage, frozenset())
        self.in_flight = Gate(limits.in_flight_per_uid, limits.in_flight, exempt)
        self.bodies = Gate(limits.body_bytes_per_uid, limits.body_bytes, exempt)
        self.quiet = QuietLog()
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._open: dict[_Connection, asyncio.Task[None]] = {}
        self._closed = asyncio.Event()

    @property
    def connections(self) -> int:
        """The connections open now."""
        return len(self._open)

    def full_of(self, uid: int | None) -> str:
        """Which connection cap ``uid`` is over ("uid" or "total")."""
        exempt = uid in self.limits.exempt_uids
        return "uid" if not exempt and self.open.of(uid) >= self.open.per_uid else "total"

    def refused(self, uid: int | None, what: str, why: str) -> str:
        """Log (at most once per uid per 10 s) that ``uid`` was refused ``what`` because
        ``why`` cap is full; the refusal's message."""
        gate = {"connections": self.open, "requests in flight": self.in_flight}.get(what)
        if why == "uid":
            cap = f"{gate.per_uid} of yours" if gate else "your share"
        else:
            cap = f"{gate.total} on the agent, everyone's" if gate else "the agent's whole budget"
        self.quiet.warn(uid, "uid %s refused: too many %s at once (%s cap)", uid, what, why)
        return (
            f"too many {what} at once ({cap} are in use); finish or close some, and retry "
            f"after {self.limits.retry_after} s"
        )

    async def close(self, timeout: float = 30.0) -> None:
        """Stop accepting; close idle connections now and the others once answered (or cut
        after ``timeout``); then run the app's ``on_cleanup``. Once; later calls wait for it."""
        if self.closing:
            await self._closed.wait()
            return
        self.closing = True
        try:
            if self._accepting is not None:
                self._accepting.cancel()
                await asyncio.gather(self._accepting, return_exceptions=True)
            if self._sock is not None:
                self._sock.close()
            for conn, task in list(self._open.items()):
                if not conn.busy:
                    task.cancel()
            await self._finish(timeout)
            for callback in self.app.on_cleanup:
                await callback(self.app)
        finally:
            self._closed.set()

    def _listen(self, sock: socket.socket) -> None:
        # Our own accept loop, not asyncio.start_server: it knows the peer's uid before it
        # spends anything on a connection, and at the descriptor limit it waits and says so
        # once, where asyncio's logs a traceback per try. (It never unlinks the socket's file,
        # which systemd's socket unit owns.)
        sock.setblocking(False)
        self._sock = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock))

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(sock)
            except OSError as exc:
                why = "descriptors are out" if exc.errno in _OUT_OF_FDS else "it failed"
                self.quiet.warn("accept", "cannot accept a connection (%s: %s); retrying", why, exc)
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            self._admit(client)

    def _admit(self, client: socket.socket) -> None:
        uid = peer_uid(client)
        triage = False
        why = self.open.take(uid)
        if why is not None:
            reason = self.refused(uid, "connections", why)
            if self.over.take(uid) is not None:
                self._turn_away(client, reason)
                return
            triage = True
        conn = _Connection(self, client, uid, triage)
        task = asyncio.get_running_loop().create_task(conn.run())
        self._open[conn] = task
        task.add_done_callback(lambda _: self._gone(conn))

    def _turn_away(self, client: socket.socket, reason: str) -> None:
        """Refuse a connection of a flood without reading it: its 429 goes out in one send
        (the kernel keeps it for the client to read after the close), and it is closed."""
        refusal = self.app.error_response(429, reason)
        body = refusal._payload() or b""
        fields = [("Content-Type", refusal.headers.get("Content-Type", "text/plain"))]
        fields += [
            ("Content-Length", str(len(body))),
            ("Retry-After", str(self.limits.retry_after)),
        ]
        head = [f"HTTP/1.1 429 {phrase(429)}", *(f"{k}: {v}" for k, v in fields)]
        try:
            client.setblocking(False)
            client.send("\r\n".join([*head, "Connection: close", "", ""]).encode() + body)
        except OSError:
            pass  # the client is gone, or reads nothing: it is closed all the same
        finally:
            client.close()

    def _gone(self, conn: _Connection) -> None:
        if self._open.pop(conn, None) is not None:
            (self.over if conn.triage else self.open).give(conn.uid)

    async def _finish(self, timeout: float) -> None:
        tasks = list(self._open.values())
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=timeout)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(
    app: Application,
    sock: socket.socket,
    *,
    keepalive_timeout: float = 75.0,
    limits: Limits | None = None,
) -> Serving:
    """Serve ``app`` on ``sock``, a bound and listening unix socket (systemd's, say)."""
    serving = Serving(app, keepalive_timeout, limits or Limits())
    serving._listen(sock)
    return serving


async def serve_path(
    app: Application,
    path: str,
    *,
    keepalive_timeout: float = 75.0,
    limits: Limits | None = None,
) -> Serving:
    """Serve ``app`` on a new unix socket at ``path`` (a stale socket file there is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return await serve(app, sock, keepalive_timeout=keepalive_timeout, limits=limits)
