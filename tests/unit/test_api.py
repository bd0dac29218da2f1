"""The HTTP layer over a real unix socket: identity, envelopes, OpenAPI, the client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from slicebox.client import Client
from slicebox.host.identity import SystemUsers
from slicebox.host.listen import activated_sockets, bind_unix
from slicebox.model import errors
from slicebox.model.api import RunRequest
from slicebox.server.api import ENGINE, Route, base_routes, build_app, json_ok, parse_body
from slicebox.web.request import Request
from slicebox.web.response import StreamResponse
from slicebox.web.server import serve


class Echo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    count: int = 1


async def echo(request: Request) -> StreamResponse:
    return json_ok(await parse_body(request, Echo))


async def run(request: Request) -> StreamResponse:
    return json_ok(await parse_body(request, RunRequest))


async def boom(request: Request) -> StreamResponse:
    raise RuntimeError("secret internals")


async def missing(request: Request) -> StreamResponse:
    raise errors.NotFound("no sandbox sbx-1; list yours with GET /v1/sandboxes")


ROUTES = [
    *base_routes(),
    Route("POST", "/echo", echo, "echo", Echo, Echo),
    Route("POST", "/run", run, "a real request model", RunRequest, RunRequest),
    Route("GET", "/boom", boom, "fails"),
    Route("GET", "/missing", missing, "not found"),
]


ENGINE_FOUND = "unix:///run/docker.sock (the system's Docker socket)"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "agent.sock"
    sock = bind_unix(path, group=None)
    loop = asyncio.new_event_loop()
    app = build_app(ROUTES, SystemUsers(), {ENGINE: ENGINE_FOUND})
    serving = loop.run_until_complete(serve(app, sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield path
    asyncio.run_coroutine_threadsafe(serving.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    sock.close()


def raw(path: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_socket_mode_is_0660(server: Path) -> None:
    assert stat.S_IMODE(server.stat().st_mode) == 0o660


def test_health_names_the_kernel_identified_caller(server: Path) -> None:
    health = Client(str(server)).request("GET", "/health")
    assert health["status"] == "ok"
    assert health["user"] == "root"
    assert health["admin"] is True
    assert health["engine"] == ENGINE_FOUND  # which engine the agent uses, and how it found it


def test_valid_body_round_trips(server: Path) -> None:
    assert Client(str(server)).request("POST", "/echo", {"name": "a"}) == {"name": "a", "count": 1}


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"name": "a", "extra": 1}, "invalid_field", "extra"),
        ({"name": "a", "count": "many"}, "invalid_field", "count"),
        ({}, "invalid_field", "name"),
    ],
)
def test_schema_errors_name_the_field(
    server: Path, body: dict[str, object], code: str, field: str
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        Client(str(server)).request("POST", "/echo", body)
    assert caught.value.code == code
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"exec": {"argv": []}}, "invalid_command", "exec.argv"),
        ({"exec": {"argv": ["ls"], "timeout": 0}}, "invalid_timeout", "exec.timeout"),
        ({"sandbox": {"project": "p", "memory": [1]}}, "invalid_limit", "sandbox.memory"),
        ({"sandbox": {"project": 5}}, "invalid_name", "sandbox.project"),
        ({"sandbox": {"project": "p", "ttl_seconds": -1}}, "invalid_ttl", "sandbox.ttl_seconds"),
        (
            {"sandbox": {"project": "p", "mounts": [{"source": "/x"}]}},
            "invalid_mount",
            "sandbox.mounts.0.target",
        ),
        ({"sandbox": {"project": "p", "image": 3}}, "invalid_field", "sandbox.image"),
    ],
)
def test_schema_errors_keep_the_fields_own_code(
    server: Path, fields: dict[str, dict[str, object]], code: str, field: str
) -> None:
    body = {"sandbox": {"project": "p"}, "exec": {"argv": ["ls"]}} | fields
    with pytest.raises(errors.InvalidRequest) as caught:
        Client(str(server)).request("POST", "/run", body)
    assert (caught.value.code, caught.value.field) == (code, field)
    assert caught.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (
            b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n"
            b"Connection: close\r\n\r\n{nop}",
            400,
            "malformed_json",
        ),
        (
            b"GET /v1/nowhere HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            404,
            "unknown_route",
        ),
        (
            b"DELETE /v1/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            405,
            "method_not_allowed",
        ),
        (b"GET /v1/boom HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", 500, "internal"),
        (
            b"GET /v1/missing HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            404,
            "not_found",
        ),
    ],
)
def test_every_error_is_an_envelope(
    server: Path, request_bytes: bytes, status: int, code: str
) -> None:
    answer = raw(server, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == str(status).encode()
    assert f'"code": "{code}"'.encode() in body or f'"code":"{code}"'.encode() in body
    assert b"secret internals" not in body


def test_a_number_too_long_to_read_is_malformed_json_not_a_crash(server: Path) -> None:
    body = b'{"name": "a", "count": 1' + b"0" * 5000 + b"}"
    head = b"POST /v1/echo HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
    answer = raw(server, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    status, _, envelope = answer.partition(b"\r\n\r\n")
    assert status.split()[1] == b"400"
    assert json.loads(envelope)["code"] == "malformed_json"


def test_huge_body_is_refused_with_413(server: Path) -> None:
    with pytest.raises(errors.SliceboxError) as caught:
        Client(str(server)).request("POST", "/echo", {"name": "x" * (2 * 1024 * 1024)})
    assert caught.value.code == "body_too_large"


def test_openapi_document_lists_routes_and_models(server: Path) -> None:
    document = Client(str(server)).request("GET", "/openapi.json")
    assert document["openapi"].startswith("3.1")
    assert "post" in document["paths"]["/v1/echo"]
    assert "Echo" in document["components"]["schemas"]
    assert "ErrorBody" in document["components"]["schemas"]


def test_unreachable_agent_says_what_to_check(tmp_path: Path) -> None:
    with pytest.raises(errors.Unavailable, match=r"slicebox\.socket"):
        Client(str(tmp_path / "none.sock")).request("GET", "/health")


def test_activated_sockets_only_for_this_pid() -> None:
    assert activated_sockets({"LISTEN_PID": "1", "LISTEN_FDS": "1"}, os.getpid()) == []
    assert activated_sockets({}, os.getpid()) == []


def test_an_agent_that_does_not_answer_is_unavailable_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    silent = bind_unix(path, group=None)  # listens, never answers
    with silent, pytest.raises(errors.Unavailable) as caught:
        Client(str(path), timeout=0.5).request("GET", "/health")
    assert caught.value.code == "agent_no_answer"
