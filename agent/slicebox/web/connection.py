"""One client's connection to the server: its requests one after the other, while it keeps it.

h11 parses and frames (held strict by ``web.heads``); a ``Connection`` moves the bytes with
time limits and counts what a request holds against its uid's caps (``web.limits``). A request
body nobody read is drained only when it is small (``DRAIN_MAX``) and was asked for; otherwise
the answer says ``Connection: close`` and, when the client may still be sending, the connection
lingers (answer sent, writing shut, the rest read away and dropped) so the refusal is heard.
``100 Continue`` goes out only when a handler first reads the body. A streamed answer's
handler is cancelled when its caller leaves (the connection's end, the peer gone: ``POLLHUP``
on a unix socket), so a stream that prints nothing holds nothing of its caller's for long;
any other handler finds out when it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import h11

from slicebox.web.app import HTTPError
from slicebox.web.heads import answer_fields, request_head, status_of
from slicebox.web.message import (
    MAX_HEAD_BYTES,
    READ_SIZE,
    BodyCutOff,
    ProtocolError,
    is_bodiless,
    phrase,
    says_close,
)
from slicebox.web.request import BodyStalled, Content, Request

if TYPE_CHECKING:
    from slicebox.web.limits import PeerKey
    from slicebox.web.response import StreamResponse
    from slicebox.web.server import Serving

log = logging.getLogger("slicebox.web.server")  # the server's one logger, as web.limits' is

DRAIN_MAX = 64 * 1024  # an unread request body up to this is read away to keep the connection
CLOSE_WAIT = 5.0  # for a closing connection to flush; a client that does not read is cut
LINGER_TIME, LINGER_IDLE = 30.0, 5.0  # a refused body read away, at most so long (nginx's)


def peer_gone(transport: asyncio.BaseTransport | None) -> bool:
    """Whether a unix socket's peer closed its end whole (``POLLHUP``), not only its writing
    (a half-close, after which it may still read). A TCP peer's close looks like a half-close
    until a write meets its reset: never taken for gone here."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return any(events & select.POLLHUP for _, events in poller.poll(0))


class Exchange:
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


class Connection:
    """One client's connection: its requests one after the other, while it keeps it. h11
    parses and frames; this moves the bytes, with time limits, and counts what is held."""

    def __init__(
        self,
        serving: Serving,
        sock: socket.socket,
        uid: PeerKey,
        triage: bool,
        *,
        listener: str = "",
        refusal: StreamResponse | None = None,
    ) -> None:
        self._serving = serving
        self.limits = serving.limits
        self.uid = uid
        self.listener = listener  # the listener of its own that accepted it ("": the main one)
        self.refusal = refusal  # what its one request is answered, its listener's vet said
        self.triage = triage  # over a connection cap: one head read, health or a refusal
        self._sock: socket.socket | None = sock
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.transport: asyncio.Transport | None = None
        self.busy = False  # in the middle of a request, not waiting for the next
        self._eof = False
        self._now = Exchange()
        self._watch: asyncio.Task[None] | None = None  # for a hang-up while a stream runs

    async def run(self) -> None:
        sock, self._sock = self._sock, None
        assert sock is not None
        try:
            if sock.family == socket.AF_UNIX:
                self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
            else:  # the metrics listener's TCP peer
                self._reader, self._writer = await asyncio.open_connection(sock=sock)
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
            await self._unwatch()  # before anything else reads the connection
            return await self._reusable()
        finally:
            await self._unwatch()
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
                raise ProtocolError(str(exc), status_of(exc)) from exc
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
        head, headers, length, chunked = request_head(event)
        expect = self._h11.they_are_waiting_for_100_continue
        body = Content(self, length, chunked, expect)
        self._now = Exchange(body=body, expect=expect)
        return Request(self._serving.app, self, head, headers, body)

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
                raise ProtocolError(str(exc), status_of(exc)) from exc
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
        if self.refusal is not None:
            return self.refusal
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
        self._now = Exchange(refused=True)
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
        body = self._now.body
        if payload is None and (body is None or body.done) and not self._eof:
            task = asyncio.current_task()
            assert task is not None
            self._watch = asyncio.get_running_loop().create_task(self._hang_up(task))

    async def _hang_up(self, answering: asyncio.Task[Any]) -> None:
        """While a stream is answered and its request is whole, the client's leaving is its
        connection's end, with nothing written (a silent stream would hold its share until it
        next printed): then the answer is cancelled, as a failed write would end it. Bytes
        that come instead (a pipelined request's) are kept for after the answer; a client
        that only shut its writing down (still reading) is not gone: its end is kept too."""
        assert self._reader is not None
        try:
            data = await self._reader.read(READ_SIZE)
        except ConnectionError:
            data = b""
        self._eof = not data
        self._h11.receive_data(data)
        if not data and peer_gone(self.transport):
            answering.cancel()

    async def _unwatch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None and not watch.done():
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def send_data(self, data: bytes) -> None:
        await self._write(self._h11.send_with_data_passthrough(h11.Data(data=data)) or [])

    async def send_end(self) -> None:
        await self._write([self._h11.send(h11.EndOfMessage()) or b""])

    def _fields(self, status: int, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        return answer_fields(status, headers, self.limits.retry_after, not self._keeps(headers))

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
