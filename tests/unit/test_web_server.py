"""slicebox.web.server on real unix sockets: what handlers see, and the bytes on the wire.

Protocol tests talk over raw connections and read the answers with the small parser below,
independent of slicebox.web; the rest go through ``HttpClient``. Every test runs on its own
loop, bounded in time, and fails if a task it started outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from slicebox.web.app import AppKey, Application, Handler, HTTPError
from slicebox.web.client import HttpClient
from slicebox.web.limits import Limits
from slicebox.web.request import Request
from slicebox.web.response import Response, StreamResponse, json_response
from slicebox.web.server import Serving, serve_path

T = TypeVar("T")
Raw = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Answer = tuple[int, dict[str, str], bytes]
GET = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
MiB = 1024 * 1024
pytestmark = pytest.mark.filterwarnings("error")  # a socket left unclosed fails its test


def run(main: Callable[[], Awaitable[T]], within: float = 5.0) -> T:
    """``main`` on a new loop, bounded; no task it started may be left running."""

    async def bounded() -> T:
        async with asyncio.timeout(within):
            result = await main()
        left = asyncio.all_tasks() - {asyncio.current_task()}
        assert not left, f"tasks left running: {left}"
        return result

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def served(
    tmp_path: Path, app: Application, keepalive_timeout: float = 75.0, limits: Limits | None = None
) -> AsyncIterator[Serving]:
    serving = await serve_path(
        app, str(tmp_path / "web.sock"), keepalive_timeout=keepalive_timeout, limits=limits
    )
    try:
        yield serving
    finally:
        await serving.close(timeout=1)
    assert serving.connections == 0


@contextlib.asynccontextmanager
async def raw(tmp_path: Path) -> AsyncIterator[Raw]:
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "web.sock"))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def client(tmp_path: Path) -> AsyncIterator[HttpClient]:
    async with HttpClient.unix(str(tmp_path / "web.sock")) as http:
        yield http


async def answer(reader: asyncio.StreamReader) -> Answer:
    """One answer off a raw connection: status, headers (lower-cased), body."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    start, *lines = head.split("\r\n")[:-2]
    headers = {name.lower(): value.strip() for name, _, value in (x.partition(":") for x in lines)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = await dechunk(reader)
    else:
        body = await reader.read()
    return int(start.split()[1]), headers, body


async def dechunk(reader: asyncio.StreamReader) -> bytes:
    pieces = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        pieces.append(await reader.readexactly(size))
        assert await reader.readexactly(2) == b"\r\n"
    assert await reader.readuntil(b"\r\n") == b"\r\n"
    return b"".join(pieces)


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read() == b""
    except ConnectionResetError:  # closed with bytes of ours unread: a reset after the answer
        return True


async def echo(request: Request) -> StreamResponse:
    body = await request.read()
    seen = {"path": request.path, "query": request.query, "match": request.match_info}
    return json_response(seen | {"body": body.decode(), "method": request.method})


def echo_app(client_max_size: int = MiB) -> Application:
    app = Application(client_max_size=client_max_size)
    for path in ("/echo", "/items/{id}", "/items/{id}/parts/{part}"):
        app.router.add_route("POST", path, echo)
        app.router.add_get(path, echo)
    return app


def test_a_route_matches_whole_decoded_segments_and_parses_the_query(tmp_path: Path) -> None:
    async def main() -> list[dict[str, object]]:
        async with served(tmp_path, echo_app()), client(tmp_path) as http:
            got = []
            for target in ("/items/a%20b%2Cc?x=1&y=&x=2", "/items/7/parts/p+1?q=a+b%26"):
                got.append(json.loads(await (await http.request("GET", target)).read()))
            for target in ("/items/a%2F..%2Fb", "/items/a%2fb", "/items/a%00b"):  # never a/../b
                smuggled = await http.request("GET", target)
                assert smuggled.status == 400, target
                await smuggled.read()
            for target in ("/items/", "/items", "/items/1/other", "/echo/1"):
                missing = await http.request("GET", target)
                assert (missing.status, await missing.read()) == (404, b"Not Found")
            return got

    first, second = run(main)
    assert first == {"path": "/items/a b,c", "query": {"x": "2", "y": ""},
                     "match": {"id": "a b,c"}, "body": "", "method": "GET"}  # fmt: skip
    assert second["match"] == {"id": "7", "part": "p+1"}
    assert second["query"] == {"q": "a b&"}


def test_a_middleware_sees_and_answers_404_and_405(tmp_path: Path) -> None:
    seen: list[int] = []

    async def envelope(request: Request, handler: Handler) -> StreamResponse:
        try:
            return await handler(request)
        except HTTPError as exc:
            seen.append(exc.status)
            return json_response({"code": exc.reason}, status=exc.status)

    async def main() -> list[tuple[int, bytes]]:
        app = Application(middlewares=[envelope])
        app.router.add_get("/items/{id}", echo)
        async with served(tmp_path, app), client(tmp_path) as http:
            nowhere = await http.request("GET", "/nowhere")
            wrong = await http.request("DELETE", "/items/1")
            return [(nowhere.status, await nowhere.read()), (wrong.status, await wrong.read())]

    assert run(main) == [(404, b'{"code": "Not Found"}'), (405, b'{"code": "Method Not Allowed"}')]
    assert seen == [404, 405]


def test_an_http_error_no_middleware_answers_goes_through_error_response(tmp_path: Path) -> None:
    async def main() -> list[Answer]:
        app = Application(error_response=lambda status, reason: Response(text=f"E{status}"))
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(
                b"GET /none HTTP/1.1\r\nHost: x\r\n\r\nGET /none HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            return [await answer(reader), await answer(reader)]

    assert [(status, body) for status, _, body in run(main)] == [(200, b"E404")] * 2


def test_state_of_the_app_and_of_each_request(tmp_path: Path) -> None:
    greeting = AppKey("greeting", str)

    async def tag(request: Request, handler: Handler) -> StreamResponse:
        request["who"] = "alice"
        return await handler(request)

    async def hello(request: Request) -> StreamResponse:
        assert "who" in request
        return Response(text=f"{request.app[greeting]}, {request['who']}")

    async def main() -> bytes:
        app = Application(middlewares=[tag])
        assert greeting not in app
        app[greeting] = "hello"
        app.router.add_get("/", hello)
        async with served(tmp_path, app), client(tmp_path) as http:
            return await (await http.request("GET", "/")).read()

    assert run(main) == b"hello, alice"
    assert repr(greeting) == "<AppKey greeting>"


def test_keep_alive_serves_requests_one_after_the_other_and_pipelined(tmp_path: Path) -> None:
    async def main() -> list[Answer]:
        async with served(tmp_path, echo_app()) as serving, raw(tmp_path) as (reader, writer):
            writer.write(GET)
            answers = [await answer(reader)]
            writer.write(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi" + GET
            )  # one send
            answers += [await answer(reader), await answer(reader)]
            assert serving.connections == 1
            return answers

    first, second, third = run(main)
    assert [status for status, _, _ in (first, second, third)] == [200, 200, 200]
    assert json.loads(second[2])["body"] == "hi"
    assert all("connection" not in headers for _, headers, _ in (first, second, third))


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nHost: x\r\nconnection: keep-alive, Close\r\n\r\n",
        b"GET /echo HTTP/1.0\r\n\r\n",
    ],
)
def test_connection_close_and_http_1_0_close_after_the_answer(
    tmp_path: Path, request_bytes: bytes
) -> None:
    async def main() -> tuple[Answer, bool]:
        async with served(tmp_path, echo_app()), raw(tmp_path) as (reader, writer):
            writer.write(request_bytes + GET)
            return await answer(reader), await closed(reader)

    (status, headers, _), was_closed = run(main)
    assert (status, headers["connection"], was_closed) == (200, "close", True)


def test_a_stream_to_an_http_1_0_client_ends_with_the_connection(tmp_path: Path) -> None:
    async def stream(request: Request) -> StreamResponse:
        response = StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        for piece in (b"one ", b"two"):
            await response.write(piece)
        await response.write_eof()
        return response

    async def main() -> list[Answer]:
        app = Application()
        app.router.add_get("/", stream)
        async with served(tmp_path, app):
            answers = []
            for version in (b"1.0", b"1.1"):
                async with raw(tmp_path) as (reader, writer):
                    writer.write(b"GET / HTTP/%b\r\nHost: x\r\nConnection: close\r\n\r\n" % version)
                    answers.append(await answer(reader))
            return answers

    (_, old, old_body), (_, new, new_body) = run(main)
    assert old_body == new_body == b"one two"
    assert "transfer-encoding" not in old
    assert "content-length" not in old
    assert new["transfer-encoding"] == "chunked"


def test_a_json_body_and_a_chunked_body_are_read_whole(tmp_path: Path) -> None:
    chunked = b"3;ext=1\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\nTrailer: x\r\n\r\n"

    async def main() -> list[object]:
        async with served(tmp_path, echo_app()), raw(tmp_path) as (reader, writer):
            payload = json.dumps({"a": [1, 2]}).encode()
            writer.write(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(payload)
            )
            writer.write(
                payload + b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            writer.write(chunked + GET)
            return [json.loads((await answer(reader))[2])["body"] for _ in range(3)]

    as_json, dechunked, empty = run(main)
    assert json.loads(str(as_json)) == {"a": [1, 2]}
    assert dechunked == "abc0123456789abcdef"
    assert empty == ""


def test_a_body_over_the_limit_is_refused_unread_and_the_connection_closed(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[Answer, bool]:
        async with served(tmp_path, echo_app(client_max_size=1024)), raw(tmp_path) as (r, w):
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (10 * MiB))
            w.write(b"x" * 1000)  # of 10 MiB: a server reading them would wait for the rest
            return await answer(r), await closed(r)

    (status, headers, _), was_closed = run(main)
    assert (status, headers["connection"], was_closed) == (413, "close", True)


def test_100_continue_is_sent_only_when_the_handler_reads_the_body(tmp_path: Path) -> None:
    async def main() -> tuple[bytes, Answer, Answer]:
        async with served(tmp_path, echo_app(client_max_size=1024)) as serving:
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n")
                writer.write(b"Content-Length: 5\r\n\r\n")
                interim = await reader.readuntil(b"\r\n\r\n")  # nothing else comes before
                writer.write(b"hello")
                read = await answer(reader)
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n")
                writer.write(b"Content-Length: %d\r\n\r\n" % MiB)
                refused = await answer(reader)
                assert await closed(reader)
            assert serving.connections == 0
            return interim, read, refused

    interim, read, refused = run(main)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert json.loads(read[2])["body"] == "hello"
    assert (refused[0], refused[1]["connection"]) == (413, "close")


def test_no_100_continue_when_the_handler_answers_without_the_body(tmp_path: Path) -> None:
    async def ignore(request: Request) -> StreamResponse:
        return Response(b"no")

    async def main() -> tuple[Answer, bool]:
        app = Application()
        app.router.add_route("PUT", "/", ignore)
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(
                b"PUT / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 9\r\n\r\n"
            )
            return await answer(reader), await closed(reader)  # the first answer is the final

    (status, headers, body), was_closed = run(main)
    assert (status, body, headers["connection"]) == (200, b"no", "close")
    assert was_closed  # the body held back is never asked for: the connection cannot go on


def test_a_small_unread_body_is_drained_and_a_large_one_closes(tmp_path: Path) -> None:
    async def ignore(request: Request) -> StreamResponse:
        return Response(b"ok")

    async def main() -> tuple[Answer, Answer, Answer, bool]:
        app = Application()
        app.router.add_route("POST", "/", ignore)
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 100)
            small = await answer(reader)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"3\r\nabc\r\n0\r\n\r\n")
            chunked = await answer(reader)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % MiB)
            large = await answer(reader)
            return small, chunked, large, await closed(reader)

    small, chunked, large, was_closed = run(main)
    assert "connection" not in small[1]
    assert "connection" not in chunked[1]
    assert (large[1]["connection"], was_closed) == ("close", True)


def test_a_stream_waits_for_a_slow_reader(tmp_path: Path) -> None:
    chunks, size = 200, 64 * 1024
    written: list[int] = []

    async def stream(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        for _ in range(chunks):
            await response.write(b"y" * size)
            written.append(size)
        await response.write_eof()
        return response

    async def main() -> tuple[int, int, int]:
        app = Application()
        app.router.add_get("/", stream)
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.3)  # the client reads nothing meanwhile
            paused = len(written)
            await asyncio.sleep(0.2)
            still = len(written)
            status, _, body = await answer(reader)
            assert status == 200
            return paused, still, len(body)

    paused, still, received = run(main)
    assert paused == still < chunks // 4  # the handler waits: its writes are not queued up
    assert received == chunks * size
    assert len(written) == chunks


def test_a_client_gone_mid_stream_ends_its_handler(tmp_path: Path) -> None:
    """Seen at the handler's next write (ConnectionError), or at the connection's end (the
    handler cancelled), whichever comes first."""

    async def main() -> BaseException:
        ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

        async def endless(request: Request) -> StreamResponse:
            response = StreamResponse()
            await response.prepare(request)
            try:
                while True:
                    await response.write(b"z" * 4096)
            except (ConnectionError, asyncio.CancelledError) as exc:
                ended.set_result(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            return response

        app = Application()
        app.router.add_get("/", endless)
        async with served(tmp_path, app):
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader.readexactly(10_000)
            return await ended

    assert isinstance(run(main), ConnectionError | asyncio.CancelledError)


def test_a_silent_stream_is_cancelled_when_its_client_leaves_and_not_at_a_half_close(
    tmp_path: Path,
) -> None:
    """A stream that prints nothing after its head: its client's leaving cancels the handler
    at once (before: it held on until its next write, a silent exec's share with it); a client
    that only shut its writing down still gets the rest of the answer."""

    async def main() -> tuple[bool, bytes]:
        cancelled = asyncio.Event()
        go_on = asyncio.Event()

        async def silent(request: Request) -> StreamResponse:
            response = StreamResponse()
            await response.prepare(request)
            try:
                await go_on.wait()
                await response.write(b"late")
                await response.write_eof()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return response

        app = Application()
        app.router.add_get("/", silent)
        async with served(tmp_path, app):
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader.readuntil(b"\r\n\r\n")  # the head: the stream is on
            async with asyncio.timeout(2):
                await cancelled.wait()
            async with raw(tmp_path) as (reader, writer):
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                await reader.readuntil(b"\r\n\r\n")
                cancelled.clear()
                writer.write_eof()  # a half-close: still reading
                await asyncio.sleep(0.3)
                kept = not cancelled.is_set()
                go_on.set()
                rest = await dechunk(reader)
        return kept, rest

    kept, rest = run(main)
    assert kept, "a half-closed client is still there"
    assert rest == b"late"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /echo\r\n\r\n", 400),
        (b"GET  /echo HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /echo HTTP/1.x\r\n\r\n", 400),
        (b"G(T /echo HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET echo HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /echo HTTP/2.0\r\n\r\n", 505),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nNo colon\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nBad name: x\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nA: 1\r\n folded\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
        (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            400,
        ),
        (
            b"POST /echo HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
        ),
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400),
        (
            b"POST /echo HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0x1\r\na\r\n0\r\n\r\n",
            400,
        ),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\n" + b"X: 1\r\n" * 12_000 + b"\r\n", 431),
    ],
)
def test_a_request_that_is_not_http_is_answered_by_error_response_and_closed(
    tmp_path: Path, request_bytes: bytes, status: int
) -> None:
    async def main() -> tuple[Answer, bool]:
        app = echo_app()
        app.error_response = lambda status, reason: json_response({"why": reason}, status)
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(request_bytes + GET)
            return await answer(reader), await closed(reader)

    (got, headers, body), was_closed = run(main)
    assert (got, headers["connection"], was_closed) == (status, "close", True)
    assert json.loads(body)["why"]


def test_a_stream_returned_unended_cuts_the_connection(tmp_path: Path) -> None:
    async def partial(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        await response.write(b"partial")
        return response

    async def main() -> tuple[bytes, bytes]:
        app = Application()
        app.router.add_get("/", partial)
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + GET)
            head = await reader.readuntil(b"\r\n\r\n")
            return head, await reader.read()

    head, rest = run(main)
    assert b"Transfer-Encoding: chunked" in head
    assert rest == b"7\r\npartial\r\n"  # no last chunk, no second answer: the end is a close


def test_an_answer_sent_early_is_not_sent_again(tmp_path: Path) -> None:
    async def early(request: Request) -> StreamResponse:
        response = Response(b"once", content_type="text/plain")
        await response.prepare(request)
        await response.write_eof()
        await response.write_eof()
        return response

    async def main() -> tuple[Answer, Answer]:
        app = Application()
        app.router.add_get("/", early)
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            return await answer(reader), await answer(reader)

    first, second = run(main)
    assert first[0] == second[0] == 200
    assert first[1]["content-type"] == "text/plain"
    assert first[2] == second[2] == b"once"


def test_an_unhandled_exception_is_logged_and_answered_500(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def boom(request: Request) -> StreamResponse:
        raise RuntimeError("secret")

    async def bad_header(request: Request) -> StreamResponse:
        return Response(headers={"X-Injected": "a\r\nSet-Cookie: b"})

    async def main() -> list[Answer]:
        app = Application()
        app.router.add_get("/boom", boom)
        app.router.add_get("/header", bad_header)
        async with served(tmp_path, app), raw(tmp_path) as (reader, writer):
            writer.write(
                b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /header HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            return [await answer(reader), await answer(reader)]

    with caplog.at_level(logging.ERROR, logger="slicebox.web.server"):
        answers = run(main)
    assert [(status, body) for status, _, body in answers] == [(500, b"Internal Server Error")] * 2
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [RuntimeError, ValueError]


def test_close_waits_for_an_answer_in_progress_then_cleans_up(tmp_path: Path) -> None:
    events: list[str] = []

    async def main() -> tuple[Answer, bool]:
        release = asyncio.Event()

        async def slow(request: Request) -> StreamResponse:
            await release.wait()
            events.append("answered")
            return Response(b"done")

        async def clean_up(app: Application) -> None:
            events.append("cleaned up")

        app = Application()
        app.router.add_get("/", slow)
        app.on_cleanup.append(clean_up)
        serving = await serve_path(app, str(tmp_path / "web.sock"))
        async with raw(tmp_path) as (reader, writer):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.05)
            closing = asyncio.create_task(serving.close())
            await asyncio.sleep(0.1)
            assert not closing.done()
            release.set()
            got = await answer(reader)
            await closing
            await serving.close()  # again: nothing more happens
            return got, await closed(reader)

    (status, headers, body), was_closed = run(main)
    assert (status, headers["connection"], body, was_closed) == (200, "close", b"done", True)
    assert events == ["answered", "cleaned up"]


def test_close_closes_idle_connections_at_once_and_cuts_stuck_handlers(tmp_path: Path) -> None:
    cancelled: list[bool] = []

    async def stuck(request: Request) -> StreamResponse:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return Response()

    async def main() -> float:
        app = echo_app()
        app.router.add_get("/stuck", stuck)
        serving = await serve_path(app, str(tmp_path / "web.sock"))
        async with raw(tmp_path) as (idle, idle_writer), raw(tmp_path) as (_, busy_writer):
            idle_writer.write(GET)
            await answer(idle)
            busy_writer.write(b"GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.05)
            started = asyncio.get_running_loop().time()
            closing = asyncio.create_task(serving.close(timeout=0.5))
            assert await closed(idle)
            idle_after = asyncio.get_running_loop().time() - started
            await closing
        assert serving.connections == 0
        return idle_after

    assert run(main) < 0.3
    assert cancelled == [True]


def test_an_idle_connection_is_closed_after_the_keepalive_timeout(tmp_path: Path) -> None:
    async def main() -> tuple[float, int]:
        async with served(tmp_path, echo_app(), keepalive_timeout=0.2) as serving:
            async with raw(tmp_path) as (reader, writer):
                writer.write(GET)
                await answer(reader)
                started = asyncio.get_running_loop().time()
                assert await closed(reader)
                waited = asyncio.get_running_loop().time() - started
            await asyncio.sleep(0.01)
            return waited, serving.connections

    waited, left = run(main)
    assert 0.15 < waited < 1
    assert left == 0
