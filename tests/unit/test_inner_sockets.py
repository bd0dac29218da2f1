"""A nested sandbox's socket on real unix sockets (server.inner, web.server's listeners): only
a process in the sandbox's cgroup is served, its requests know which socket took them, a
socket is capped on its own, re-made over a stale file, and closed with its connections."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import pytest

from slicebox.core.innerdirs import inner_directory
from slicebox.core.sandbox import Sandbox
from slicebox.host.peercgroup import peer_cgroup, within
from slicebox.model.labels import Lineage
from slicebox.model.limits import Limits
from slicebox.server.inner import InnerListeners
from slicebox.web.app import Application
from slicebox.web.limits import Limits as SocketLimits
from slicebox.web.request import Request
from slicebox.web.response import StreamResponse, json_response
from slicebox.web.server import serve_path

T = TypeVar("T")
NOW = datetime(2026, 1, 2, tzinfo=UTC)


def run(main: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(10):
            return await main()

    return asyncio.run(bounded())


def own_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    pytest.skip("no cgroup v2 line for this process")


def nested_sandbox(
    *,
    sandbox_id: str = "sbx-000000000001",
    user: str = "root",  # an account this machine has
    max_children: int = 2,
    ancestors: str = "",
) -> Sandbox:
    """A nested parent as its labels say."""
    lineage = Lineage(
        sandbox_id=sandbox_id,
        instance_id="run-1",
        root_task_id="t",
        task_id="t",
        user=user,
        project="web",
        created_at=NOW,
        provisioned_cpu=1.0,
        provisioned_memory_bytes=256 << 20,
        provisioned_pids=100,
        nested=True,
        nested_max_children=max_children,
        nested_max_depth=2,
        ancestors=ancestors,
    )
    return Sandbox(
        id=sandbox_id,
        container_id="c" * 64,
        user=user,
        project="web",
        lineage=lineage,
        limits=Limits(cpus=1.0, memory_bytes=256 << 20, pids=100),
        backend="docker",
        created_at=NOW,
        expires_at=None,
    )


class Setup:
    """An app that answers with the listener, the nested sockets below ``tmp``, one sandbox."""

    def __init__(self, tmp: Path) -> None:
        self.app = Application()
        self.app.router.add_get("/who", who)
        self.inner = InnerListeners(tmp / "nested")
        self.box = nested_sandbox()
        self.path = tmp / "nested" / self.box.id / "slicebox.sock"


async def who(request: Request) -> StreamResponse:
    return json_response({"listener": request.listener})


async def ask(path: Path, *, parse: bool = True) -> tuple[int, Any]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(b"GET /who HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if parse else body.decode()


def test_only_a_process_of_the_sandbox_is_served_and_its_requests_know_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = Setup(tmp_path)
    app, inner, box, path = made.app, made.inner, made.box, made.path

    async def main() -> None:
        serving = await serve_path(app, str(tmp_path / "main.sock"))
        inner.attach(serving)
        try:
            await inner.open(box)
            assert oct(path.stat().st_mode & 0o777) == "0o666"
            status, body = await ask(path)  # this process is in no sandbox's cgroup
            assert (status, body["code"]) == (403, "nested_refused")
            # As though this process ran in the sandbox: its scope is our own cgroup.
            monkeypatch.setitem(inner._scopes, box.id, own_cgroup())
            status, body = await ask(path)
            assert (status, body) == (200, {"listener": box.id})
            await inner.open(box)  # a restarted agent: the stale file replaced, served again
            monkeypatch.setitem(inner._scopes, box.id, own_cgroup())
            assert (await ask(path))[0] == 200
            assert await inner.sync(set()) == [box.id]
            assert not path.parent.exists()
            with pytest.raises(FileNotFoundError):
                await ask(path)
        finally:
            await serving.close(timeout=1)

    run(main)


def test_a_socket_has_its_own_cap_on_connections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = Setup(tmp_path)
    app, inner, box, path = made.app, made.inner, made.box, made.path
    limits = SocketLimits(connections_per_listener=2, exempt_uids=frozenset())

    async def main() -> None:
        serving = await serve_path(app, str(tmp_path / "main.sock"), limits=limits)
        inner.attach(serving)
        held: list[asyncio.StreamWriter] = []
        try:
            await inner.open(box)
            monkeypatch.setitem(inner._scopes, box.id, own_cgroup())
            for _ in range(2):
                held.append((await asyncio.open_unix_connection(str(path)))[1])
            await asyncio.sleep(0.1)
            status, text = await ask(path, parse=False)
            assert status == 429
            assert "on this socket" in str(text)
        finally:
            for writer in held:
                writer.close()
            await serving.close(timeout=1)

    run(main)


def test_the_peer_s_cgroup_is_the_kernel_s_answer() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        assert peer_cgroup(left) == own_cgroup()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with tcp:
        assert peer_cgroup(tcp) is None


@pytest.mark.parametrize(
    ("cgroup", "scope", "inside"),
    [
        ("/a.slice/docker-1.scope", "a.slice/docker-1.scope", True),
        ("/a.slice/docker-1.scope/init", "/a.slice/docker-1.scope", True),
        ("/a.slice/docker-12.scope", "/a.slice/docker-1.scope", False),
        ("/a.slice", "/a.slice/docker-1.scope", False),
        ("/", "/a.slice/docker-1.scope", False),
    ],
)
def test_within_is_the_scope_or_below(cgroup: str, scope: str, inside: bool) -> None:
    assert within(cgroup, scope) is inside
    assert str(PurePosixPath(scope)) == scope.rstrip("/")


def test_the_directory_of_a_create_in_flight_is_spared_and_a_stray_one_removed(
    tmp_path: Path,
) -> None:
    """A create makes its sandbox's socket directory before the engine knows the sandbox; a
    sweep that took it for a stray failed the create's start (runc: no source to bind), seen
    in a slow CI lane. The sweep spares what its caller says is in flight."""
    made = Setup(tmp_path)
    inner = made.inner
    creating = inner_directory(tmp_path / "nested", "sbx-00000000000c")
    stray = inner_directory(tmp_path / "nested", "sbx-00000000000d")

    async def main() -> None:
        seen = inner.directories()
        assert seen == {creating.name, stray.name}
        assert await inner.sync(set(), seen, frozenset({creating.name})) == []
        assert creating.is_dir()
        assert not stray.exists()
        await inner.sync(set())  # done, and not running: the next sweep takes it
        assert not creating.exists()

    run(main)
