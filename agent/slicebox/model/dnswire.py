"""DNS messages on the wire (RFC 1035), as much as the egress resolver needs: read a client's
query, build a refusal for it, read the A/AAAA addresses (and TTLs) an upstream answered, and
build an answer (the test zone's). Standard library only; anything malformed is
``DnsFormatError``, never an ``IndexError`` or ``struct.error``.
"""

import struct
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv6Address
from typing import NamedTuple

A, CNAME, AAAA, IN = 1, 5, 28, 1
NOERROR, SERVFAIL, NXDOMAIN, REFUSED = 0, 2, 3, 5
_HEADER = struct.Struct("!HHHHHH")
_QR, _AA, _TC, _RD, _RA = 0x8000, 0x0400, 0x0200, 0x0100, 0x0080
_MAX_JUMPS = 64


class DnsFormatError(ValueError):
    """A message that is malformed, or not what the resolver takes."""


class Question(NamedTuple):
    name: str  # lower case, no trailing dot; "" for the root
    qtype: int
    qclass: int


class Query(NamedTuple):
    id: int
    flags: int
    question: Question
    raw: bytes  # the whole message, as the client sent it
    end: int  # where the question ends in ``raw``


class Answer(NamedTuple):
    rcode: int
    truncated: bool
    addresses: tuple[tuple[IPv4Address | IPv6Address, int], ...]  # (address, TTL)
    names: tuple[str, ...]  # the question's name, then each CNAME target in the chain


def encode_name(name: str) -> bytes:
    out = b""
    for label in name.rstrip(".").split(".") if name.strip(".") else []:
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DnsFormatError(f"a label of {len(raw)} bytes in {name!r}")
        out += bytes([len(raw)]) + raw
    if len(out) + 1 > 255:
        raise DnsFormatError(f"{name!r} is longer than 255 bytes")
    return out + b"\0"


def decode_name(data: bytes, offset: int, *, pointers: bool = True) -> tuple[str, int]:
    """The name at ``offset`` and the offset just past it there (pointers followed)."""
    labels: list[str] = []
    end: int | None = None
    jumps, length = 0, 0
    while True:
        size = _byte(data, offset)
        if size & 0xC0 == 0xC0:
            if not pointers:
                raise DnsFormatError("a compression pointer in a query's question")
            target = ((size & 0x3F) << 8) | _byte(data, offset + 1)
            if target >= offset or jumps >= _MAX_JUMPS:
                raise DnsFormatError("a compression pointer that does not point back")
            end = offset + 2 if end is None else end
            offset, jumps = target, jumps + 1
            continue
        if size & 0xC0:
            raise DnsFormatError("an unknown label type")
        if size == 0:
            return ".".join(labels).lower(), (offset + 1 if end is None else end)
        label = data[offset + 1 : offset + 1 + size]
        if len(label) != size:
            raise DnsFormatError("a label past the end of the message")
        length += size + 1
        if length > 254:
            raise DnsFormatError("a name longer than 255 bytes")
        labels.append(label.decode("ascii", errors="replace"))
        offset += 1 + size


def parse_query(data: bytes) -> Query:
    query_id, flags, qdcount, ancount, nscount, _ = _header(data)
    if flags & _QR or (flags >> 11) & 0xF != 0:
        raise DnsFormatError("not a standard query")
    if qdcount != 1 or ancount or nscount:
        raise DnsFormatError("a query asks exactly one question and answers nothing")
    question, end = _question(data, _HEADER.size, pointers=False)
    return Query(query_id, flags, question, bytes(data), end)


def parse_response(data: bytes, query: Query) -> Answer:
    response_id, flags, qdcount, ancount, _, _ = _header(data)
    if not flags & _QR or response_id != query.id or qdcount != 1:
        raise DnsFormatError("not the response to this query")
    question, offset = _question(data, _HEADER.size)
    if question != query.question:
        raise DnsFormatError("a response to another question")
    records: list[tuple[str, int, int, bytes]] = []
    for _ in range(ancount):
        owner, offset = decode_name(data, offset)
        rtype, _, ttl, size = _fields(data, offset, "!HHIH")
        rdata_at = offset + 10
        rdata = data[rdata_at : rdata_at + size]
        if len(rdata) != size:
            raise DnsFormatError("a record past the end of the message")
        value = decode_name(data, rdata_at)[0].encode() if rtype == CNAME else rdata
        records.append((owner, rtype, ttl, value))
        offset = rdata_at + size
    return _chain(flags, question.name, records)


def _chain(flags: int, name: str, records: list[tuple[str, int, int, bytes]]) -> Answer:
    names = [name]
    while len(names) <= len(records):
        target = next((v for o, t, _, v in records if o == names[-1] and t == CNAME), None)
        if target is None or target.decode() in names:
            break
        names.append(target.decode())
    addresses: list[tuple[IPv4Address | IPv6Address, int]] = []
    for owner, rtype, ttl, value in records:
        if owner in names and (rtype, len(value)) in ((A, 4), (AAAA, 16)):
            address = IPv4Address(value) if rtype == A else IPv6Address(value)
            addresses.append((address, ttl))
    return Answer(flags & 0xF, bool(flags & _TC), tuple(addresses), tuple(names))


def reply(query: Query, rcode: int) -> bytes:
    """An answerless response to ``query`` with ``rcode``; its question as the client wrote it."""
    return _response(query, rcode, 0, 0) + query.raw[_HEADER.size : query.end]


def build_query(name: str, qtype: int, query_id: int, *, recursion: bool = True) -> bytes:
    flags = _RD if recursion else 0
    return (
        _HEADER.pack(query_id, flags, 1, 0, 0, 0)
        + encode_name(name)
        + struct.pack("!HH", qtype, IN)
    )


def build_response(
    query: Query, records: Sequence[tuple[str, int, int, str]], rcode: int = NOERROR
) -> bytes:
    """A response with ``records``: (owner, type, TTL, value: an address, or a CNAME's name)."""
    out = _response(query, rcode, len(records), _AA) + query.raw[_HEADER.size : query.end]
    for owner, rtype, ttl, value in records:
        if rtype == A:
            rdata = IPv4Address(value).packed
        elif rtype == AAAA:
            rdata = IPv6Address(value).packed
        else:
            rdata = encode_name(value)
        out += encode_name(owner) + struct.pack("!HHIH", rtype, IN, ttl, len(rdata)) + rdata
    return out


def _response(query: Query, rcode: int, ancount: int, extra: int) -> bytes:
    flags = _QR | _RA | extra | (query.flags & _RD) | (rcode & 0xF)
    return _HEADER.pack(query.id, flags, 1, ancount, 0, 0)


def _header(data: bytes) -> tuple[int, int, int, int, int, int]:
    if len(data) < _HEADER.size:
        raise DnsFormatError("shorter than a DNS header")
    return _HEADER.unpack_from(data)


def _question(data: bytes, offset: int, *, pointers: bool = True) -> tuple[Question, int]:
    name, offset = decode_name(data, offset, pointers=pointers)
    qtype, qclass = _fields(data, offset, "!HH")
    return Question(name, qtype, qclass), offset + 4


def _fields(data: bytes, offset: int, layout: str) -> tuple[int, ...]:
    try:
        return struct.unpack_from(layout, data, offset)
    except struct.error as exc:
        raise DnsFormatError("a record past the end of the message") from exc


def _byte(data: bytes, offset: int) -> int:
    if offset >= len(data):
        raise DnsFormatError("a name past the end of the message")
    return data[offset]
