"""HTTP/1.1 messages on an asyncio stream: the head, the headers, the body's framing.

The client (``web.client``) reads answers with it, from the agent and from dockerd; the server
parses requests with h11 (``web.connection``, ``web.heads``), where any local user is the peer,
and shares only the errors and helpers here. The parse is
strict where leniency is a known smuggling or exhaustion risk: a head is bounded, both
Content-Length and Transfer-Encoding is refused, so is any coding but exactly ``chunked``, and
conflicting lengths. A body is never held whole by the reader: it hands out what the socket
has, at most one read's worth at a time, so an upload of gigabytes keeps memory flat.

Errors::

    ProtocolError(Exception)            the bytes are not a well-formed message (``status``)
    BodyCutOff(ConnectionResetError)    the peer closed before the body ended
    BodyTooLarge(Exception)             ``readall`` over its ``limit``
"""

from __future__ import annotations

import asyncio
import http
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping

MAX_HEAD_BYTES = 64 * 1024
READ_SIZE = 64 * 1024  # what one read of a body hands out at most, by default
LAST_CHUNK = b"0\r\n\r\n"
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")  # 15 digits: up to 1 EiB, and no int() surprises
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_STATUS = re.compile(rb"[1-9][0-9][0-9]")

BeforeRead = Callable[[], Awaitable[None]]


class ProtocolError(Exception):
    """A malformed HTTP message on the wire; ``status`` is what a server answers it with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class BodyCutOff(ConnectionResetError):
    """The peer closed the connection before the body ended."""


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the body is larger than {limit} bytes")
        self.limit = limit


class Headers(Mapping[str, str]):
    """Header fields by case-insensitive name (iterated lower-cased); a repeated name keeps
    its last value."""

    __slots__ = ("_fields",)

    def __init__(self, fields: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        pairs = fields.items() if isinstance(fields, Mapping) else fields
        self._fields = {name.lower(): value for name, value in pairs}

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"Headers({self._fields!r})"


async def read_head(reader: asyncio.StreamReader) -> list[bytes] | None:
    """The lines of a message's head, without their line endings and the blank line ending
    it; None when the connection ends (EOF or reset) before any byte."""
    lines: list[bytes] = []
    size = 0
    while True:
        line = await _head_line(reader, started=size > 0)
        if line is None:
            return None
        size += len(line)
        if size > MAX_HEAD_BYTES:
            raise ProtocolError(f"the message head is over {MAX_HEAD_BYTES} bytes", 431)
        line = line.rstrip(b"\r\n")
        if line:
            lines.append(line)
        elif lines:  # blank lines before a start line are tolerated (RFC 9112 2.2)
            return lines


async def _head_line(reader: asyncio.StreamReader, started: bool) -> bytes | None:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError as exc:
        raise ProtocolError(f"the message head is over {MAX_HEAD_BYTES} bytes", 431) from exc
    except asyncio.IncompleteReadError as exc:
        if started or exc.partial:
            raise BodyCutOff("the connection closed in the middle of a message head") from exc
        return None
    except ConnectionError:
        if started:
            raise
        return None


def parse_status_line(line: bytes) -> tuple[tuple[int, int], int, str]:
    """(version, status, reason) of ``HTTP/1.1 200 OK``; the reason may be empty."""
    parts = line.split(b" ", 2)
    version = _version(parts[0])
    if len(parts) < 2 or version is None or not _STATUS.fullmatch(parts[1]):
        raise ProtocolError(f"malformed status line {line[:100]!r}")
    return version, int(parts[1]), parts[2].decode("latin-1") if len(parts) == 3 else ""


def _version(word: bytes) -> tuple[int, int] | None:
    matched = _VERSION.fullmatch(word)
    if matched is None:
        return None
    if matched[1] != b"1":
        raise ProtocolError(f"HTTP version {word.decode()} is not spoken here", 505)
    return 1, int(matched[2])


def parse_headers(lines: Iterable[bytes]) -> Headers:
    """Header lines (``Name: value``) as ``Headers``; a malformed one is a ProtocolError."""
    pairs: list[tuple[str, str]] = []
    lengths: set[str] = set()
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not is_token(name):  # also refuses obs-fold continuation lines
            raise ProtocolError(f"malformed header line {line[:100]!r}")
        pairs.append((name.decode("ascii").lower(), value.strip(b" \t").decode("latin-1")))
        if pairs[-1][0] == "content-length":
            lengths.add(pairs[-1][1])
    if len(lengths) > 1:
        raise ProtocolError("conflicting Content-Length headers")
    return Headers(pairs)


def framing(headers: Headers) -> tuple[int | None, bool]:
    """The body's framing as (Content-Length, chunked); (None, False) when neither is given."""
    coding = headers.get("transfer-encoding")
    length = headers.get("content-length")
    if coding is not None and length is not None:
        raise ProtocolError("both Content-Length and Transfer-Encoding")
    if coding is not None:
        if coding.strip().lower() != "chunked":
            raise ProtocolError(f"unsupported Transfer-Encoding {coding[:100]!r}", 501)
        return None, True
    if length is None:
        return None, False
    if not length.isascii() or not length.isdigit():
        raise ProtocolError(f"malformed Content-Length {length[:100]!r}")
    return int(length), False


def says_close(headers: Mapping[str, str]) -> bool:
    """Whether ``headers`` (a message's, or a plain dict of any case) say ``Connection: close``."""
    value = next((v for name, v in headers.items() if name.lower() == "connection"), "")
    return "close" in {token.strip().lower() for token in value.split(",")}


def is_bodiless(status: int) -> bool:
    """Whether an answer of ``status`` never has a body (RFC 9112 6.3)."""
    return status < 200 or status in (204, 304)


def phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def format_head(start: str, fields: Iterable[tuple[str, str]]) -> bytes:
    """A message head: the start line, the fields, the blank line. A line break inside a
    field would smuggle another into the message: it is a ValueError."""
    lines = [start, *(f"{name}: {value}" for name, value in fields)]
    text = "\r\n".join(lines)
    if text.count("\n") != len(lines) - 1 or text.count("\r") != len(lines) - 1:
        raise ValueError(f"a line break inside a field of {start!r}")
    return (text + "\r\n\r\n").encode()


def is_token(data: bytes) -> bool:
    """Whether ``data`` is an HTTP token (a method, a header name)."""
    return _TOKEN.fullmatch(data) is not None


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body; nothing for no data (a 0-chunk ends a body)."""
    if not data:
        return b""
    return b"%x\r\n%b\r\n" % (len(data), data)


class BodyReader:
    """One message's body on ``reader``: ``length`` bytes, chunked, or (neither: a response
    that ends with its connection) up to EOF when ``until_eof``, else empty.

    ``before_first_read`` runs once, before the first wait on the socket: the server sends
    ``100 Continue`` from it, so a body nobody reads is never asked for. ``timeout`` bounds
    each wait for bytes (TimeoutError)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        *,
        length: int | None = None,
        chunked: bool = False,
        until_eof: bool = False,
        before_first_read: BeforeRead | None = None,
        timeout: float | None = None,
    ) -> None:
        self._reader = reader
        self._length = length
        self._chunked = chunked
        self._until_eof = until_eof and length is None and not chunked
        self._left = length or 0  # of the body (Content-Length) or of the current chunk
        self._crlf_due = False  # the CRLF after a chunk's data is still to be read
        self._done = not (chunked or self._until_eof or self._left)
        self._hook = before_first_read
        self.timeout = timeout

    @property
    def done(self) -> bool:
        """The whole body has been consumed."""
        return self._done

    @property
    def length(self) -> int | None:
        """The Content-Length, when the body has one."""
        return self._length

    @property
    def remaining(self) -> int | None:
        """Bytes of a Content-Length body not yet read; None when not known in advance."""
        return self._left if self._length is not None else None

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes, as soon as any are there (``n=-1``: the whole rest); b"" at the
        end of the body."""
        if n < 0:
            return await self.readall()
        if self._done or n == 0:
            return b""
        if self._hook is not None:
            hook, self._hook = self._hook, None
            await hook()
        if self._chunked:
            return await self._read_chunked(n)
        return await self._read_plain(n)

    async def readall(self, limit: int | None = None) -> bytes:
        """The rest of the body; BodyTooLarge, before reading, when its length says it is
        over ``limit``, or as soon as more than ``limit`` bytes came."""
        if limit is not None and self._length is not None and self._length > limit:
            raise BodyTooLarge(limit)
        pieces: list[bytes] = []
        size = 0
        while piece := await self.read(READ_SIZE):
            size += len(piece)
            if limit is not None and size > limit:
                raise BodyTooLarge(limit)
            pieces.append(piece)
        return b"".join(pieces)

    async def discard(self, at_most: int) -> bool:
        """Read and drop the rest of the body if it is no more than ``at_most`` bytes; whether
        the body ended (a known longer rest is not read at all)."""
        left = self.remaining
        if left is not None and left > at_most:
            return False
        while at_most >= 0 and (piece := await self.read(READ_SIZE)):
            at_most -= len(piece)
        return self._done

    async def _read_plain(self, n: int) -> bytes:
        data = await self._wait(self._reader.read(n if self._until_eof else min(n, self._left)))
        if self._until_eof:
            self._done = not data
            return data
        if not data:
            raise BodyCutOff(f"the connection closed with {self._left} bytes of the body unsent")
        self._left -= len(data)
        self._done = self._left == 0
        return data

    async def _read_chunked(self, n: int) -> bytes:
        if self._left == 0:
            await self._next_chunk()
            if self._done:
                return b""
        data = await self._wait(self._reader.read(min(n, self._left)))
        if not data:
            raise BodyCutOff("the connection closed in the middle of a chunk")
        self._left -= len(data)
        self._crlf_due = self._left == 0
        return data

    async def _next_chunk(self) -> None:
        if self._crlf_due:
            if (await self._line()).rstrip(b"\r\n"):
                raise ProtocolError("a chunk is longer than its size says")
            self._crlf_due = False
        size = (await self._line()).split(b";", 1)[0].strip(b" \t\r\n")
        if not _HEX.fullmatch(size):
            raise ProtocolError(f"malformed chunk size {size[:20]!r}")
        self._left = int(size, 16)
        if self._left == 0:
            await self._skip_trailers()
            self._done = True

    async def _skip_trailers(self) -> None:
        size = 0
        while (line := await self._line()).rstrip(b"\r\n"):
            size += len(line)
            if size > MAX_HEAD_BYTES:
                raise ProtocolError(f"the trailers are over {MAX_HEAD_BYTES} bytes")

    async def _line(self) -> bytes:
        try:
            return await self._wait(self._reader.readuntil(b"\n"))
        except asyncio.IncompleteReadError as exc:
            raise BodyCutOff("the connection closed before the chunked body's end") from exc
        except asyncio.LimitOverrunError as exc:
            raise ProtocolError("a line of the chunked framing is too long") from exc

    async def _wait(self, read: Awaitable[bytes]) -> bytes:
        try:
            async with asyncio.timeout(self.timeout):
                return await read
        except BodyCutOff:
            raise
        except ConnectionError as exc:  # a reset is a cut-off as well as an EOF is
            raise BodyCutOff(f"the connection broke before the body's end ({exc})") from exc
