"""The socket under a hostile local user: caps per uid and in all, refused at once with 429 and
Retry-After (health answered over them), time limits on heads, bodies and readers that do not
read, a memory budget for bodies, quiet logs; and strict HTTP/1.1 parsing (h11), answered 400
(505, 431) for every leniency a smuggling attempt leans on, fuzzed."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slicebox.server.api import http_error
from slicebox.web.app import Application
from slicebox.web.limits import Gate, Limits, QuietLog
from slicebox.web.request import Request
from slicebox.web.response import Response, StreamResponse
from slicebox.web.server import Serving
from tests.httpcorpus import SMUGGLING
from tests.unit.test_web_server import GET, Answer, answer, closed, echo, raw, run, served

pytestmark = pytest.mark.filterwarnings("error")
HEALTH = frozenset({("GET", "/health")})
ME = os.getuid()


def caps(**options: Any) -> Limits:
    """``Limits`` that hold the uid running the tests (root, often) to its own share too."""
    return Limits(**({"exempt_uids": frozenset()} | options))


async def health(request: Request) -> StreamResponse:
    return Response(b"ok", content_type="text/plain")


def capped_app(release: asyncio.Event | None = None) -> Application:
    async def slow(request: Request) -> StreamResponse:
        assert release is not None
        await release.wait()
        return Response(b"done", content_type="text/plain")

    app = Application(client_max_size=4 * 1024 * 1024)  # as the agent's exec route
    app.router.add_get("/health", health)
    app.router.add_get("/slow", slow)
    for path in ("/echo", "/items/{id}"):
        app.router.add_route("POST", path, echo)
        app.router.add_get(path, echo)
    return app


async def until(check: Any, within: float = 2.0) -> None:
    async with asyncio.timeout(within):
        while not check():
            await asyncio.sleep(0.01)


def errors_in(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What a hostile client must never cause: an error, or a traceback at any level."""
    return [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# -- caps --------------------------------------------------------------------------------


def test_connections_over_the_uid_cap_are_refused_at_once_and_health_still_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limits = caps(connections_per_uid=2, always=HEALTH)

    async def main() -> tuple[Answer, bool, Answer]:
        async with served(tmp_path, capped_app(), limits=limits) as serving:
            async with raw(tmp_path), raw(tmp_path):
                await until(lambda: serving.connections == 2)
                async with raw(tmp_path) as (reader, writer):
                    writer.write(GET)
                    refused = await answer(reader), await closed(reader)
                async with raw(tmp_path) as (reader, writer):
                    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    healthy = await answer(reader)
            return *refused, healthy

    (status, headers, body), was_closed, healthy = run(main)
    assert (status, headers["retry-after"], headers["connection"], was_closed) == (
        429, "1", "close", True)  # fmt: skip
    assert b"too many connections" in body
    assert b"2 of yours" in body
    assert healthy[0] == 200
    assert healthy[2] == b"ok"
    assert not errors_in(caplog)


def test_a_flood_past_the_connections_read_for_health_is_answered_429_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limits = caps(connections_per_uid=1, triage_per_uid=1, always=HEALTH)

    async def main() -> tuple[Answer, bool, int]:
        async with (
            served(tmp_path, capped_app(), limits=limits) as serving,
            raw(tmp_path),  # served
            raw(tmp_path),  # read for a head
        ):
            await until(lambda: serving.connections == 2)
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n")
                got = await answer(reader), await closed(reader)
            return *got, serving.connections

    (status, headers, body), was_closed, open_ = run(main)
    assert (status, headers["retry-after"], headers["connection"]) == (429, "1", "close")
    assert (was_closed, open_) == (True, 2)
    assert b"too many connections" in body
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


def test_requests_in_flight_over_the_cap_are_refused_and_the_connection_stays(
    tmp_path: Path,
) -> None:
    limits = caps(in_flight_per_uid=2, always=HEALTH)

    async def main() -> list[int]:
        release = asyncio.Event()
        async with (
            served(tmp_path, capped_app(release), limits=limits) as serving,
            raw(tmp_path) as (r1, w1),
            raw(tmp_path) as (r2, w2),
            raw(tmp_path) as (r3, w3),
        ):
            slow = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
            w1.write(slow)
            w2.write(slow)
            await until(lambda: serving.in_flight.held == 2)
            w3.write(slow + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            statuses = [(await answer(r3))[0], (await answer(r3))[0]]
            release.set()
            statuses += [(await answer(r1))[0], (await answer(r2))[0]]
            w3.write(GET)  # the refused connection goes on, once others are done
            statuses.append((await answer(r3))[0])
            assert serving.in_flight.held == 0
            return statuses

    assert run(main) == [429, 200, 200, 200, 200]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (caps(body_bytes_per_uid=1000), b"your share"),
        (caps(body_bytes=1000, exempt_uids=frozenset({ME})), b"the agent's whole budget"),
    ],
    ids=["uid", "total (the uid exempt from its own share, like root)"],
)
def test_bodies_held_at_once_are_bounded_and_a_refusal_comes_before_the_body(
    tmp_path: Path, limits: Limits, message: bytes
) -> None:
    async def main() -> tuple[Answer, Answer, int]:
        async with served(tmp_path, capped_app(), limits=limits) as serving:
            async with raw(tmp_path) as (r1, w1), raw(tmp_path) as (r2, w2):
                w1.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 800\r\n\r\n" + b"x")
                await until(lambda: serving.bodies.held == 800)
                w2.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 300\r\n\r\n")
                refused = await answer(r2)  # no byte of the body was sent
                w1.write(b"x" * 799)
                done = await answer(r1)
            async with raw(tmp_path) as (r3, w3):  # chunked: counted as it comes
                w3.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
                w3.write(b"400\r\n" + b"y" * 1024 + b"\r\n0\r\n\r\n")
                chunked = await answer(r3)
            return refused, chunked, done[0]

    (status, headers, body), chunked, done = run(main)
    assert (status, headers["retry-after"], done, chunked[0]) == (429, "1", 200, 429)
    assert b"request body memory" in body
    assert message in body


def test_gate_exempts_a_uid_from_its_share_never_from_the_total() -> None:
    gate = Gate(per_uid=2, total=3, exempt=frozenset({0}))
    assert [gate.take(1000), gate.take(1000), gate.take(1000)] == [None, None, "uid"]
    assert [gate.take(0), gate.take(0)] == [None, "total"]
    gate.give(1000)
    assert gate.take(0) is None
    assert (gate.held, gate.of(0), gate.of(1000)) == (3, 2, 1)


def test_the_refusal_log_says_one_line_per_uid_per_ten_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr("slicebox.web.limits.time.monotonic", lambda: now[0])
    quiet = QuietLog()
    with caplog.at_level(logging.WARNING, "slicebox.web.server"):
        for _ in range(50):
            quiet.warn(1000, "refused %s", 1000)
            quiet.warn(1001, "refused %s", 1001)
            now[0] += 0.1  # 5 s in all
        now[0] += 5.1
        quiet.warn(1000, "refused %s", 1000)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["refused 1000", "refused 1001", "refused 1000"]
    assert quiet.suppressed == 98


def test_the_code_of_a_refusal_is_too_many_requests() -> None:
    response = http_error(429, "too many connections at once")
    assert json.loads(response.body)["code"] == "too_many_requests"
    assert response.status == 429


def test_accept_out_of_descriptors_waits_says_so_once_and_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        real, failures = loop.sock_accept, [0]

        async def scarce(sock: socket.socket) -> tuple[socket.socket, Any]:
            if failures[0] < 5:
                failures[0] += 1
                await asyncio.sleep(0)
                raise OSError(errno.EMFILE, "Too many open files")
            return await real(sock)

        loop.sock_accept = scarce  # type: ignore[method-assign]
        async with served(tmp_path, capped_app()), raw(tmp_path) as (reader, writer):
            writer.write(GET)
            return (await answer(reader))[0]

    with caplog.at_level(logging.INFO):
        assert run(main) == 200
    said = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(said) == 1
    assert "descriptors are out" in said[0].getMessage()
    assert not errors_in(caplog)


# -- time limits -------------------------------------------------------------------------


def test_a_head_that_does_not_end_in_time_is_answered_408_and_closed(tmp_path: Path) -> None:
    async def main() -> tuple[Answer, bool]:
        limits = caps(head_timeout=0.3)
        async with served(tmp_path, capped_app(), limits=limits), raw(tmp_path) as (reader, writer):
            writer.write(b"GET /echo HTTP/1.1\r\nHo")
            return await answer(reader), await closed(reader)

    (status, headers, _), was_closed = run(main)
    assert (status, headers["connection"], was_closed) == (408, "close", True)


def test_a_stalled_body_is_answered_408_and_its_memory_given_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limits = caps(body_idle=0.3)

    async def main() -> tuple[Answer, bool, int]:
        async with served(tmp_path, capped_app(), limits=limits) as serving:
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4194304\r\n\r\n")
                writer.write(b"x" * 1000)
                got = await answer(reader), await closed(reader)
            return *got, serving.bodies.held

    (status, headers, _), was_closed, held = run(main)
    assert (status, headers["connection"], was_closed, held) == (408, "close", True, 0)
    assert not errors_in(caplog)


def test_a_body_dripped_slower_than_the_whole_body_time_is_answered_408(tmp_path: Path) -> None:
    limits = caps(body_idle=1.0, body_timeout=0.5)

    async def main() -> int:
        async with served(tmp_path, capped_app(), limits=limits), raw(tmp_path) as (r, w):
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            for _ in range(8):
                w.write(b"x")
                await asyncio.sleep(0.1)
            return (await answer(r))[0]

    assert run(main) == 408


def test_a_reader_that_reads_nothing_is_cut_a_slow_one_is_served(tmp_path: Path) -> None:
    ended: list[str] = []

    async def endless(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        try:
            for _ in range(400):
                await response.write(b"z" * 16384)
            await response.write_eof()
            ended.append("whole")
        except ConnectionError:
            ended.append("cut")
        return response

    async def main() -> int:
        app = Application()
        app.router.add_get("/", endless)
        async with served(tmp_path, app, limits=caps(write_stall=0.4)) as serving:
            async with raw(tmp_path) as (_, writer):
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await until(lambda: ended == ["cut"], within=4)
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                got = 0
                while piece := await reader.read(65536):  # slowly, but reading
                    got += len(piece)
                    await asyncio.sleep(0.002)
            await until(lambda: serving.connections == 0)
            return got

    assert run(main, within=20) > 400 * 16384
    assert ended == ["cut", "whole"]


def test_a_client_gone_mid_body_is_closed_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> int:
        async with served(tmp_path, capped_app()) as serving:
            for framing in (
                b"Content-Length: 5000\r\n\r\n",
                b"Transfer-Encoding: chunked\r\n\r\n5",
            ):
                async with raw(tmp_path) as (_, writer):
                    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + framing + b"abc")
                    await asyncio.sleep(0.05)
            await until(lambda: serving.connections == 0)
            return serving.bodies.held

    with caplog.at_level(logging.INFO):
        assert run(main) == 0
    assert not errors_in(caplog)


# -- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(("request_bytes", "status"), SMUGGLING)
def test_the_smuggling_corpus_is_refused_and_nothing_after_it_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, request_bytes: bytes, status: int
) -> None:
    async def main() -> tuple[Answer, bool]:
        async with served(tmp_path, capped_app()), raw(tmp_path) as (reader, writer):
            writer.write(request_bytes + GET)  # never answered: where it starts is unknown
            return await answer(reader), await closed(reader)

    (got, headers, _), was_closed = run(main)
    assert (got, headers["connection"], was_closed) == (status, "close", True)
    assert not errors_in(caplog)


@pytest.mark.parametrize("target", [b"/items/a%2F..%2Fb", b"/items/a%2fb", b"/items/%00"])
def test_an_encoded_slash_or_nul_in_a_route_segment_is_400(tmp_path: Path, target: bytes) -> None:
    async def main() -> Answer:
        async with served(tmp_path, capped_app()), raw(tmp_path) as (reader, writer):
            writer.write(b"GET %b HTTP/1.1\r\nHost: x\r\n\r\n" % target)
            return await answer(reader)

    assert run(main)[0] == 400


# -- fuzz --------------------------------------------------------------------------------

PIECES = [
    b"GET ", b"POST ", b"get ", b"PUT ", b"/echo", b"/items/1", b"/items/a%2Fb", b"/health",
    b"/slow", b"/nowhere", b"?q=1", b" HTTP/1.1", b" HTTP/1.0", b" HTTP/1.9", b"\r\n", b"\n",
    b"\r", b"Host: x\r\n", b"Content-Length: 5\r\n", b"Content-Length: 0\r\n",
    b"Content-Length: -1\r\n", b"Content-Length: 99999999999999999999999\r\n",
    b"Transfer-Encoding: chunked\r\n", b"Transfer-Encoding: gzip\r\n", b"Connection: close\r\n",
    b"Expect: 100-continue\r\n", b"X: \x00\x80\r\n", b" folded\r\n", b"5\r\nhello\r\n",
    b"0\r\n\r\n", b"5 \r\n", b"ffffffff\r\n", b"hello", b"\r\n\r\n", b":", b" ", b"\t",
]  # fmt: skip
REQUESTS = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=24).map(b"".join),
    st.binary(max_size=300),
    st.tuples(
        st.lists(st.sampled_from(PIECES), max_size=12).map(b"".join), st.binary(max_size=40)
    ).map(b"".join),
)


def parse_answers(data: bytes) -> list[int]:
    """The statuses of the final answers in ``data`` (1xx left out); a torn last one too."""
    statuses = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"a torn head {data[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if "content-length" in fields:
            data = rest[int(fields["content-length"]) :]
        elif fields.get("transfer-encoding") == "chunked":
            data = b""  # a stream: the last thing on the connection here
        else:
            data = rest if status < 200 or status in (204, 304) else b""
        if status >= 200:
            statuses.append(status)
    return statuses


@settings(
    deadline=None,
    derandomize=True,
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request_bytes=REQUESTS)
def test_fuzz_never_5xx_never_hangs_never_answers_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    limits = caps(head_timeout=0.5, body_idle=0.5, triage_timeout=0.5, always=HEALTH)

    async def main() -> bytes:
        release = asyncio.Event()
        release.set()
        app = capped_app(release)
        async with (
            served(tmp_path, app, keepalive_timeout=1, limits=limits),
            raw(tmp_path) as (reader, writer),
        ):
            writer.write(request_bytes)
            with contextlib.suppress(OSError):
                writer.write_eof()
            got = b""
            with contextlib.suppress(ConnectionError):
                while piece := await reader.read(65536):
                    got += piece
            return got

    statuses = parse_answers(run(main, within=4))
    assert all(status < 500 for status in statuses), statuses
    assert len(statuses) <= max(1, request_bytes.count(b" HTTP/")), statuses
    assert not errors_in(caplog)  # nor a traceback in the log


def test_the_serving_counts_nothing_once_its_clients_are_gone(tmp_path: Path) -> None:
    async def main() -> Serving:
        async with served(tmp_path, capped_app()) as serving:
            for _ in range(3):
                async with raw(tmp_path) as (reader, writer):
                    writer.write(GET)
                    await answer(reader)
            await until(lambda: serving.connections == 0)
            return serving

    serving = run(main)
    assert (serving.open.held, serving.in_flight.held, serving.bodies.held) == (0, 0, 0)
