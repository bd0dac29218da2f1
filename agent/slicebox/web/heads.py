"""The heads the server reads and writes, held to more than HTTP's grammar.

Any local user is the server's peer, so the socket is a trust boundary: where h11 is lenient
for compatibility it is made strict (on import, before any request is parsed), and a request
head h11 accepts is checked further: HTTP/1.0 or 1.1 only, an upper-case method, ASCII fields,
one framing (both Content-Length and Transfer-Encoding is a smuggling attempt), a bounded
Content-Length, a target in origin form. An answer's fields are checked before any of the
answer goes out, so a handler's bad header is a 500, never a broken head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import h11

from slicebox.web.message import Headers, ProtocolError, is_bodiless, is_token

# (method, target in origin form, version), the fields, the Content-Length, whether chunked
RequestHead = tuple[tuple[str, str, tuple[int, int]], Headers, int | None, bool]

_METHOD = re.compile(rb"[A-Z]+")
_BAD_FIELD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # what an answer's field never carries
MAX_LENGTH_DIGITS = 18  # a Content-Length of up to 999 PB; h11 0.16 takes 20, 0.14 any


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


def status_of(exc: h11.ProtocolError) -> int:
    """The status a malformed request is answered with: h11's hint, but 400 for a transfer
    coding h11 does not take (a repeated or listed Transfer-Encoding is a smuggling attempt
    more likely than an honest client, RFC 9112 6.3)."""
    status = exc.error_status_hint
    return 400 if status == 501 else status


def origin_form(target: str) -> str:
    if target.startswith("/"):
        return target
    if "://" in target:  # absolute-form, which a server must accept too (RFC 9112 3.2.2)
        split = urlsplit(target)
        return (split.path or "/") + (f"?{split.query}" if split.query else "")
    raise ProtocolError(f"malformed request target {target[:100]!r}")


def request_head(event: h11.Request) -> RequestHead:
    """``event``'s head as the server takes it; ProtocolError when it is not one to answer."""
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
    target = origin_form(event.target.decode("ascii"))
    chunked = "transfer-encoding" in headers
    if chunked and "content-length" in headers:  # RFC 9112 6.1: a smuggling attempt
        raise ProtocolError("both Content-Length and Transfer-Encoding")
    if len(headers.get("content-length", "")) > MAX_LENGTH_DIGITS:
        raise ProtocolError("malformed Content-Length: more digits than any body here has")
    length = None if chunked or "content-length" not in headers else int(headers["content-length"])
    version = (1, int(event.http_version[2:]))
    return (event.method.decode(), target, version), headers, length, chunked


def answer_fields(
    status: int, headers: Mapping[str, str], retry_after: int, close: bool
) -> list[tuple[str, str]]:
    """An answer's fields, the server's framing left to h11; a field that would break the
    head is a ValueError (nothing of the answer went out)."""
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
        fields.append(("Retry-After", str(retry_after)))
    if close:
        fields.append(("Connection", "close"))
    return fields
