"""A request as a handler sees it: the parsed head, and the body still on the socket.

``Request`` keeps aiohttp.web's meaning: ``match_info``, ``query``, ``headers``, per-request
state, and ``read`` for the whole body. ``Content`` is the body as it comes off the connection:
read piece by piece (an upload of gigabytes keeps memory flat), or whole within the time and
memory bounds of ``Limits``. ``100 Continue`` goes out only when a handler first reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote

from slicebox.web.app import HTTPError
from slicebox.web.message import READ_SIZE, BodyCutOff, BodyTooLarge, Headers, ProtocolError

if TYPE_CHECKING:
    from slicebox.web.app import Application
    from slicebox.web.connection import Connection


class Request:
    """One request: its head parsed, its body still on the socket (``content``)."""

    def __init__(
        self,
        app: Application,
        conn: Connection,
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
        self.route = ""  # the route's pattern once routed (``Router.resolve``); "": none
        self.client_max_size = app.client_max_size
        self._conn = conn
        self._state: dict[Hashable, Any] = {}
        self._body: bytes | None = None

    @property
    def listener(self) -> str:
        """The name of the listener of its own that accepted the connection (a nested
        sandbox's socket: ``Serving.add_listener``); "" for the main socket."""
        return self._conn.listener

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


class Content:
    """A request's body as it comes off the connection (h11 frames it): ``read`` hands out
    what arrived, at most ``n`` bytes, never holding more than one read's worth; ``readall``
    the whole of it, within the time and memory bounds of ``Limits``."""

    def __init__(self, conn: Connection, length: int | None, chunked: bool, expect: bool) -> None:
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
