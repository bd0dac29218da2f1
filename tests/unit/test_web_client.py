"""slicebox.web.client against real unix sockets: slicebox's own server where an answer is
well-formed, and a raw asyncio server where the test needs bytes no good server sends (a body
cut short, an answer that never comes, a connection closed under a request)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from slicebox.web.app import Application
from slicebox.web.client import HttpClient
from slicebox.web.message import BodyCutOff, ProtocolError
from slicebox.web.request import Request
from slicebox.web.response import Response, StreamResponse, json_response
from tests.unit.test_web_server import run, served

Talk = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
pytestmark = pytest.mark.filterwarnings("error")  # a socket left unclosed fails its test


def pool(tmp_path: Path, limit: int = 16) -> HttpClient:
    return HttpClient.unix(str(tmp_path / "web.sock"), limit=limit)


@contextlib.asynccontextmanager
async def raw_server(tmp_path: Path, *talks: Talk) -> AsyncIterator[list[int]]:
    """A server that talks ``talks[n]`` on its n-th connection (the last one on later ones);
    yields how many connections it took."""
    accepted: list[int] = []
    running: set[asyncio.Task[None]] = set()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        running.add(task)
        accepted.append(len(accepted))
        try:
            await talks[min(len(accepted), len(talks)) - 1](reader, writer)
        finally:
            writer.close()
            running.discard(task)

    server = await asyncio.start_unix_server(on_connection, str(tmp_path / "web.sock"))
    try:
        yield accepted
    finally:
        server.close()
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await server.wait_closed()


def answering(*answers: bytes | None) -> Talk:
    """Read a request head and send an answer, for each of ``answers`` (None: close instead);
    then wait for the client to close."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for each in answers:
            await reader.readuntil(b"\r\n\r\n")
            if each is None:
                return
            writer.write(each)
            await writer.drain()
        await reader.read()

    return talk


async def counting(request: Request) -> StreamResponse:
    """The caller's connection, as its transport's id: the same for requests on one."""
    return json_response({"connection": id(request.transport)})


def app_of(**routes: Callable[[Request], Awaitable[StreamResponse]]) -> Application:
    app = Application()
    for path, handler in routes.items():
        app.router.add_route("GET", f"/{path}", handler)
        app.router.add_route("PUT", f"/{path}", handler)
    return app


def test_sequential_requests_reuse_one_connection(tmp_path: Path) -> None:
    async def main() -> set[tuple[bytes, int]]:
        async with served(tmp_path, app_of(who=counting)) as serving, pool(tmp_path) as http:
            seen = set()
            for _ in range(5):
                response = await http.request("GET", "/who")
                seen.add((await response.read(), serving.connections))
            return seen

    assert len(run(main)) == 1  # one connection id, one connection open all along


def test_no_more_than_limit_connections_are_open_at_once(tmp_path: Path) -> None:
    async def main() -> tuple[int, list[int]]:
        release, inside = asyncio.Event(), [0]

        async def held(request: Request) -> StreamResponse:
            inside[0] += 1
            await release.wait()
            return Response(b"done")

        async with served(tmp_path, app_of(held=held)) as serving, pool(tmp_path, 2) as http:

            async def one() -> bytes:
                return await (await http.request("GET", "/held")).read()

            calls = [asyncio.create_task(one()) for _ in range(5)]
            await asyncio.sleep(0.1)
            at_most = serving.connections
            assert inside[0] == 2
            release.set()
            assert await asyncio.gather(*calls) == [b"done"] * 5
            return at_most, [serving.connections, inside[0]]

    assert run(main) == (2, [2, 5])


def test_a_kept_connection_the_server_closed_is_dropped_before_use(tmp_path: Path) -> None:
    async def main() -> list[bytes]:
        app = app_of(who=counting)
        async with served(tmp_path, app, keepalive_timeout=0.05), pool(tmp_path) as http:
            first = await (await http.request("GET", "/who")).read()
            await asyncio.sleep(0.2)  # the server closed it, idle
            return [first, await (await http.request("GET", "/who")).read()]

    first, second = run(main)
    assert first != second  # a new connection, and no error


def test_a_request_cut_by_the_server_on_a_kept_connection_is_sent_once_more(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[list[bytes], list[int]]:
        cut = answering(OK, None)
        async with raw_server(tmp_path, cut, answering(OK)) as accepted, pool(tmp_path) as http:
            bodies = [await (await http.request("GET", "/")).read()]
            bodies.append(await (await http.request("PUT", "/", body=b"again")).read())
            return bodies, accepted

    bodies, accepted = run(main)
    assert bodies == [b"ok", b"ok"]
    assert accepted == [0, 1]  # the retry went on a new connection


def test_a_streamed_body_is_not_sent_twice_nor_a_first_request(tmp_path: Path) -> None:
    async def stream() -> AsyncIterator[bytes]:
        yield b"once"

    async def main() -> list[int]:
        cut = answering(OK, None)
        async with raw_server(tmp_path, cut, answering(None)) as accepted, pool(tmp_path) as http:
            await (await http.request("GET", "/")).read()
            with pytest.raises(ConnectionResetError):
                await http.request("PUT", "/", body=stream())
            with pytest.raises(ConnectionResetError):  # a new connection that gets no answer
                await http.request("GET", "/")
            return accepted

    assert run(main) == [0, 1]


async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(b"the end")


@pytest.mark.parametrize(
    "talk",
    [
        close_delimited,
        answering(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 13\r\n\r\nuntil the end"
        ),
        answering(b"HTTP/1.0 200 OK\r\nContent-Length: 13\r\n\r\nuntil the end"),
    ],
    ids=["close-delimited", "connection-close", "http-1.0"],
)
def test_an_answer_that_ends_its_connection_is_read_whole_and_not_reused(
    tmp_path: Path, talk: Talk
) -> None:
    async def main() -> tuple[list[bytes], list[int]]:
        async with raw_server(tmp_path, talk) as accepted, pool(tmp_path) as http:
            bodies = [await (await http.request("GET", "/")).read() for _ in range(2)]
            return bodies, accepted

    assert run(main) == ([b"until the end"] * 2, [0, 1])


def test_chunked_and_sized_answers_are_read_whole_and_in_pieces(tmp_path: Path) -> None:
    async def stream(request: Request) -> StreamResponse:
        response = StreamResponse()
        await response.prepare(request)
        for piece in (b"a" * 70_000, b"b", b"c" * 10):
            await response.write(piece)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    async def sized(request: Request) -> StreamResponse:
        return Response(b"x" * 200_000)

    async def main() -> tuple[bytes, list[bytes], bytes, int]:
        app = app_of(stream=stream, sized=sized)
        async with served(tmp_path, app) as serving, pool(tmp_path) as http:
            whole = await (await http.request("GET", "/stream")).read()
            response = await http.request("GET", "/stream")
            assert response.headers["Transfer-Encoding"] == "chunked"
            pieces = [piece async for piece in response.iter_any()]
            async with await http.request("GET", "/sized") as answer:
                assert answer.content.length == 200_000
                body = await answer.read()
            return whole, pieces, body, serving.connections

    whole, pieces, body, connections = run(main)
    assert whole == b"".join(pieces) == b"a" * 70_000 + b"b" + b"c" * 10
    assert len(pieces) >= 3  # as they came, not gathered
    assert body == b"x" * 200_000
    assert connections == 1


@pytest.mark.parametrize(
    "cut",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
    ],
)
def test_a_body_cut_short_is_body_cut_off(tmp_path: Path, cut: bytes) -> None:
    async def cuts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(cut)

    async def main() -> None:
        async with raw_server(tmp_path, cuts), pool(tmp_path) as http:
            response = await http.request("GET", "/")
            with pytest.raises(BodyCutOff):
                await response.read()

    run(main)


@pytest.mark.parametrize(
    "bad",
    [
        b"HTTP/1.1 2OO OK\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
    ],
)
def test_an_answer_that_is_not_http_is_a_protocol_error(tmp_path: Path, bad: bytes) -> None:
    async def main() -> None:
        async with raw_server(tmp_path, answering(bad)), pool(tmp_path) as http:
            with pytest.raises(ProtocolError):
                await http.request("GET", "/")

    run(main)


def test_an_interim_100_continue_is_skipped(tmp_path: Path) -> None:
    async def main() -> tuple[int, bytes]:
        interim = b"HTTP/1.1 100 Continue\r\n\r\n" + OK
        async with raw_server(tmp_path, answering(interim)), pool(tmp_path) as http:
            response = await http.request("PUT", "/", body=b"data")
            return response.status, await response.read()

    assert run(main) == (200, b"ok")


def test_with_expect_100_continue_a_refused_upload_is_heard_and_a_taken_one_sent(
    tmp_path: Path,
) -> None:
    async def echo(request: Request) -> StreamResponse:
        return Response(await request.read())

    async def main() -> list[tuple[int, bytes]]:
        app = Application(client_max_size=1024)
        app.router.add_route("PUT", "/", echo)
        expect = {"Expect": "100-continue"}
        async with served(tmp_path, app), pool(tmp_path) as http:
            answers = []
            for body in (b"x" * (16 * 1024 * 1024), b"small"):
                response = await http.request("PUT", "/", body=body, headers=expect)
                answers.append((response.status, await response.read()))
            return answers

    assert run(main) == [(413, b"Request Entity Too Large"), (200, b"small")]


def test_read_timeout_bounds_the_wait_for_the_head_and_for_the_body(tmp_path: Path) -> None:
    async def main() -> None:
        stalled = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")
        async with raw_server(tmp_path, answering(), stalled), pool(tmp_path) as http:
            with pytest.raises(TimeoutError):
                await http.request("GET", "/", read_timeout=0.1)
            response = await http.request("GET", "/", read_timeout=0.1)
            with pytest.raises(TimeoutError):
                await response.read()

    run(main)


def test_a_streamed_upload_arrives_chunked_and_whole(tmp_path: Path) -> None:
    pieces = [bytes([n]) * (10_000 + n) for n in range(30)]

    async def digest(request: Request) -> StreamResponse:
        assert request.headers["transfer-encoding"] == "chunked"
        assert request.content_length is None
        sha, size = hashlib.sha256(), 0
        while piece := await request.content.read(8192):
            sha.update(piece)
            size += len(piece)
        return json_response({"sha": sha.hexdigest(), "size": size})

    async def generated() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece
            await asyncio.sleep(0)

    def listed() -> Iterator[bytes]:
        yield from pieces

    async def main() -> list[bytes]:
        async with served(tmp_path, app_of(digest=digest)), pool(tmp_path) as http:
            return [
                await (await http.request("PUT", "/digest", body=body)).read()
                for body in (generated(), listed())
            ]

    whole = b"".join(pieces)
    expected = f'{{"sha": "{hashlib.sha256(whole).hexdigest()}", "size": {len(whole)}}}'
    assert run(main) == [expected.encode()] * 2


def test_closing_an_answer_mid_stream_ends_the_server_s_handler(tmp_path: Path) -> None:
    """The client's close is seen at the connection's end (the handler cancelled), or at the
    handler's next write (ConnectionError), whichever comes first."""

    async def main() -> BaseException:
        ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

        async def endless(request: Request) -> StreamResponse:
            response = StreamResponse()
            await response.prepare(request)
            try:
                while True:
                    await response.write(b"z" * 1024)
                    await asyncio.sleep(0.001)
            except (ConnectionError, asyncio.CancelledError) as exc:
                ended.set_result(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            return response

        async with served(tmp_path, app_of(endless=endless)), pool(tmp_path) as http:
            response = await http.request("GET", "/endless")
            assert await response.content.read(100)
            response.close()
            return await ended

    assert isinstance(run(main), ConnectionError | asyncio.CancelledError)


def test_a_body_read_in_another_task_frees_the_connection_for_the_next(tmp_path: Path) -> None:
    async def main() -> list[bytes]:
        async with served(tmp_path, app_of(who=counting)) as serving, pool(tmp_path, 1) as http:
            first = await http.request("GET", "/who")
            reader = asyncio.create_task(first.read())
            second = await http.request("GET", "/who")  # waits for the only connection
            assert serving.connections == 1
            return [await reader, await second.read()]

    first, second = run(main)
    assert first == second


def test_a_missing_socket_is_file_not_found_and_a_closed_client_refuses(tmp_path: Path) -> None:
    async def main() -> None:
        http = pool(tmp_path)
        with pytest.raises(FileNotFoundError):
            await http.request("GET", "/")
        await http.close()
        with pytest.raises(RuntimeError):
            await http.request("GET", "/")

    run(main)
