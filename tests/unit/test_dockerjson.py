"""The exec's Engine API calls on the event loop, against a real HTTP server on a unix socket
that answers as the daemon does (its paths, its JSON, its error statuses)."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import docker
import pytest

from slicebox.backends.base import SandboxState
from slicebox.backends.docker import DockerBackend
from slicebox.backends.dockerbody import exec_body
from slicebox.backends.dockerendpoint import DockerEndpoint
from slicebox.model.errors import SandboxNotFound, SandboxNotRunning, Unavailable
from slicebox.model.exec import ExecRequest
from slicebox.web.app import Application, Handler
from slicebox.web.request import Request
from slicebox.web.response import Response, StreamResponse, json_response
from slicebox.web.server import serve_path

CONTAINER = {
    "Id": "c" * 64,
    "Name": "/sbx-1",
    "Config": {"Labels": {"slicebox.sandbox_id": "sbx-1"}},
    "State": {"Status": "running", "Running": True, "Pid": 42},
}


class Daemon:
    """What the fake daemon was asked, and its answers by path."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, Any]] = []

    async def handle(self, request: Request, _: Handler) -> Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.asked.append((request.method, request.path, body))
        path = request.path
        if path == "/version":
            return json_response({"ApiVersion": "1.45"})
        if path == f"/v1.45/containers/{'c' * 64}/json":
            return json_response(CONTAINER)
        if path == "/v1.45/containers/stopped/exec":
            message = {"message": "container stopped is not running"}
            return json_response(message, status=409)
        if path == f"/v1.45/containers/{'c' * 64}/exec":
            return json_response({"Id": "e1"}, status=201)
        if path == "/v1.45/exec/e1/json":
            return json_response({"Running": False, "ExitCode": 3, "Pid": 77})
        return json_response({"message": f"No such container: {path}"}, status=404)


class Handles(Protocol):
    async def handle(self, request: Request, _: Handler) -> Response | StreamResponse: ...


H = TypeVar("H", bound=Handles)


def with_daemon(test: Callable[[DockerBackend, Daemon], Awaitable[None]]) -> Daemon:
    return serve_daemon(Daemon(), test)


def serve_daemon(daemon: H, test: Callable[[DockerBackend, H], Awaitable[None]]) -> H:
    """Run ``test`` with a backend whose daemon is ``daemon``, on a real unix socket."""

    async def main() -> None:
        app = Application(middlewares=[daemon.handle])  # every path, whatever the routes
        with tempfile.TemporaryDirectory() as scratch:
            socket = str(Path(scratch) / "docker.sock")
            serving = await serve_path(app, socket)
            backend = DockerBackend(DockerEndpoint(scheme="unix", address=socket))
            try:
                await test(backend, daemon)
            finally:
                await backend.aclose()
                await serving.close()

    asyncio.run(main())
    return daemon


def test_an_exec_s_calls_go_to_the_daemon_s_paths_at_its_api_version() -> None:
    async def calls(backend: DockerBackend, daemon: Daemon) -> None:
        info = await backend.inspect("c" * 64)
        assert info is not None
        assert (info.name, info.state) == ("sbx-1", SandboxState.RUNNING)
        assert info.labels == {"slicebox.sandbox_id": "sbx-1"}
        request = ExecRequest(argv=("echo", "hi"), env={"A": "1"}, cwd="/w")
        assert await backend.exec_create("c" * 64, request) == "e1"
        state = await backend.exec_inspect("e1")
        assert (state.running, state.exit_code, state.pid) == (False, 3, 77)

    asked = with_daemon(calls).asked
    assert [(method, path) for method, path, _ in asked] == [
        ("GET", "/version"),  # once: the version is kept
        ("GET", f"/v1.45/containers/{'c' * 64}/json"),
        ("POST", f"/v1.45/containers/{'c' * 64}/exec"),
        ("GET", "/v1.45/exec/e1/json"),
    ]
    assert asked[2][2]["Cmd"] == ["echo", "hi"]
    assert asked[2][2]["Env"] == ["A=1"]


def test_the_daemon_s_refusals_mean_what_they_mean_through_docker_py() -> None:
    async def refusals(backend: DockerBackend, daemon: Daemon) -> None:
        assert await backend.inspect("gone") is None
        with pytest.raises(SandboxNotRunning, match="is not running"):
            await backend.exec_create("stopped", ExecRequest(argv=("x",)))
        with pytest.raises(SandboxNotFound):
            await backend.exec_inspect("e-gone")

    with_daemon(refusals)


def test_no_daemon_is_unavailable_with_what_to_check() -> None:
    async def main() -> None:
        backend = DockerBackend(DockerEndpoint(scheme="unix", address="/nonexistent/docker.sock"))
        try:
            with pytest.raises(Unavailable, match=r"is docker\.service running"):
                await backend.inspect("sbx-1")
        finally:
            await backend.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    "request_",
    [
        ExecRequest(argv=("echo", "hi")),
        ExecRequest(argv=("cat",), stdin=b"x", env={"A": "1", "B": "x=y"}, cwd="/tmp"),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_the_exec_body_is_docker_py_s_for_the_same_call(
    request_: ExecRequest, streamed: bool
) -> None:
    sent: list[dict[str, Any]] = []
    api = docker.APIClient(base_url="unix:///nonexistent", version="1.45")
    api._post_json = lambda url, data: sent.append(data)
    api._result = lambda response, as_json: {"Id": "e1"}
    api.exec_create(
        "c1",
        list(request_.argv),
        stdin=bool(request_.stdin) or streamed,
        environment=dict(request_.env),
        workdir=request_.cwd,
    )
    theirs = dict(sent[0])
    del theirs["Container"]  # the path names it; the daemon ignores the field
    assert json.loads(json.dumps(exec_body(request_, streamed))) == theirs
