"""The DNS codec the egress resolver reads queries and upstream answers with (host.dnswire)."""

from __future__ import annotations

import contextlib
import struct
from ipaddress import IPv4Address, IPv6Address

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slicebox.model import dnswire as d


def query(name: str = "PyPI.org", qtype: int = d.A, query_id: int = 4242) -> d.Query:
    return d.parse_query(d.build_query(name, qtype, query_id))


def test_a_query_round_trips_lower_cased() -> None:
    parsed = query()
    assert parsed.question == d.Question("pypi.org", d.A, d.IN)
    assert parsed.id == 4242
    assert parsed.end == len(parsed.raw)


def test_a_response_gives_the_chains_addresses_and_ttls() -> None:
    asked = query("www.example.org")
    raw = d.build_response(
        asked,
        [
            ("www.example.org", d.CNAME, 300, "cdn.example.net"),
            ("cdn.example.net", d.CNAME, 60, "edge.cdn.example.net"),
            ("edge.cdn.example.net", d.A, 20, "151.101.0.223"),
            ("edge.cdn.example.net", d.AAAA, 20, "2a04:4e42::223"),
            ("unrelated.example", d.A, 20, "10.0.0.1"),  # not in the chain: ignored
        ],
    )
    answer = d.parse_response(raw, asked)
    assert answer.rcode == d.NOERROR
    assert not answer.truncated
    assert answer.names == ("www.example.org", "cdn.example.net", "edge.cdn.example.net")
    assert answer.addresses == (
        (IPv4Address("151.101.0.223"), 20),
        (IPv6Address("2a04:4e42::223"), 20),
    )


def test_compression_pointers_are_followed() -> None:
    asked = query("pypi.org")
    header = struct.pack("!HHHHHH", asked.id, 0x8180, 1, 1, 0, 0)
    question = asked.raw[12 : asked.end]
    record = b"\xc0\x0c" + struct.pack("!HHIH", d.A, d.IN, 99, 4) + bytes([1, 2, 3, 4])
    answer = d.parse_response(header + question + record, asked)
    assert answer.addresses == ((IPv4Address("1.2.3.4"), 99),)


@pytest.mark.parametrize("pointer", [b"\xc0\x22", b"\xc0\x1a"])  # forward; to itself
def test_pointers_that_do_not_point_back_are_refused(pointer: bytes) -> None:
    asked = query("pypi.org")
    header = struct.pack("!HHHHHH", asked.id, 0x8180, 1, 1, 0, 0)
    record = pointer + struct.pack("!HHIH", d.A, d.IN, 99, 4) + bytes(4)
    with pytest.raises(d.DnsFormatError):
        d.parse_response(header + asked.raw[12 : asked.end] + record, asked)


def test_every_truncation_is_a_format_error() -> None:
    asked = query("files.pythonhosted.org")
    raw = d.build_response(asked, [("files.pythonhosted.org", d.A, 60, "151.101.1.63")])
    for length in range(len(raw)):
        with pytest.raises(d.DnsFormatError):
            d.parse_response(raw[:length], asked)
    for length in range(len(asked.raw)):
        with pytest.raises(d.DnsFormatError):
            d.parse_query(asked.raw[:length])


def test_a_response_to_something_else_is_refused() -> None:
    asked = query("pypi.org")
    other = query("pypi.org", query_id=1)
    with pytest.raises(d.DnsFormatError):
        d.parse_response(d.build_response(other, []), asked)
    with pytest.raises(d.DnsFormatError):
        d.parse_response(d.build_response(query("evil.org"), []), asked)
    with pytest.raises(d.DnsFormatError):
        d.parse_response(asked.raw, asked)  # a query is no response


def test_what_is_no_plain_query_is_refused() -> None:
    response = d.build_response(query(), [])
    with pytest.raises(d.DnsFormatError):
        d.parse_query(response)
    two = bytearray(query().raw)
    two[5] = 2  # QDCOUNT 2
    with pytest.raises(d.DnsFormatError):
        d.parse_query(bytes(two))
    with pytest.raises(d.DnsFormatError):
        d.build_query("x" * 64 + ".org", d.A, 1)


def test_a_reply_echoes_the_question_as_sent() -> None:
    asked = query("PyPI.Org")
    raw = d.reply(asked, d.NXDOMAIN)
    assert raw[12:] == asked.raw[12 : asked.end], "the client's own case"
    flags = struct.unpack("!H", raw[2:4])[0]
    assert flags & 0x8000, "a response"
    assert flags & 0x0100, "RD copied"
    assert flags & 0x0080, "RA"
    assert flags & 0xF == d.NXDOMAIN
    assert d.parse_response(raw, asked).rcode == d.NXDOMAIN


def test_the_truncation_bit_is_reported() -> None:
    asked = query()
    raw = bytearray(d.build_response(asked, []))
    raw[2] |= 0x02
    assert d.parse_response(bytes(raw), asked).truncated


@given(st.binary(max_size=300))
def test_random_bytes_raise_nothing_but_format_errors(data: bytes) -> None:
    asked = query()
    for parse in (d.parse_query, lambda raw: d.parse_response(raw, asked)):
        with contextlib.suppress(d.DnsFormatError):
            parse(data)


@given(st.binary(min_size=1, max_size=200))
def test_a_valid_start_with_random_records_raises_only_format_errors(tail: bytes) -> None:
    asked = query()
    header = struct.pack("!HHHHHH", asked.id, 0x8180, 1, 3, 0, 0)
    with contextlib.suppress(d.DnsFormatError):
        d.parse_response(header + asked.raw[12 : asked.end] + tail, asked)
