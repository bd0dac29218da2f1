"""Both Python clients against the agent's real app on a real unix socket (core over fakes)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path

import pytest

from slicebox.client import AsyncClient, Client, wire
from slicebox.core.budget import OutputBudget, exec_reservation
from slicebox.host.listen import bind_unix
from slicebox.model import errors
from slicebox.model.api import CreateSandbox, Extend, ReapRequest, RunRequest, RunResult
from slicebox.model.exec import MAX_OUTPUT_CAP, ExecRequest, ExecResult, OutputStream, StreamChunk
from tests.unit.agentserver import Agent, served, wait_for
from tests.unit.test_service import World

OUT, ERR = OutputStream.STDOUT, OutputStream.STDERR
WEB = CreateSandbox(project="web")
EXEC = ExecRequest(argv=("true",))


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with served(tmp_path) as running:
        yield running
        assert running.sandboxes() == [], "a test left a sandbox behind"


def test_every_route_answers_its_model(agent: Agent) -> None:
    client = Client(agent.socket)
    assert client.health().admin is True  # the test runs as root: the kernel says so
    box = client.create(CreateSandbox(project="web", memory="128MB", ttl_seconds=60))
    assert box.limits.memory_bytes == 128 * 1024 * 1024
    assert [v.id for v in client.list_sandboxes()] == [box.id]
    assert client.get(box.id) == box
    assert client.extend(box.id, Extend(ttl_seconds=600)).expires_at is not None
    assert client.usage(box.id).sandbox is not None
    assert client.level_tree().unit == "slicebox.slice"
    agent.script((OUT, b"hi\n"), exit_code=3)
    assert client.exec(box.id, ExecRequest(argv=("echo", "hi"))).exit_code == 3
    assert client.reap(ReapRequest(dry_run=True)).dry_run is True
    gone = client.destroy_task(box.root_task_id)
    assert [each.id for each in gone] == [box.id]
    assert client.destroy(box.id).destroyed is False  # idempotent
    agent.script((OUT, b"once\n"))
    ran = client.run(RunRequest(sandbox=WEB, exec=ExecRequest(argv=("x",))))
    assert ran.result.stdout == b"once\n"
    assert client.request("GET", "/openapi.json")["openapi"].startswith("3.1")


def slow_removals(world: World) -> threading.Event:
    """Docker's removals wait until the event returned is set."""
    gate, remove = threading.Event(), world.docker.remove

    def waiting(backend_id: str) -> bool:
        gate.wait(10)
        return remove(backend_id)

    world.docker.remove = waiting  # type: ignore[method-assign]
    return gate


def test_a_run_answers_before_docker_has_removed_its_sandbox(agent: Agent) -> None:
    world, gate = agent.world, slow_removals(agent.world)
    agent.script((OUT, b"done\n"))
    ran = Client(agent.socket).run(RunRequest(sandbox=WEB, exec=EXEC))
    assert ran.result.stdout == b"done\n"
    assert ran.usage is not None, "read before the answer, from the live cgroup"
    assert [c.name for c in world.docker.containers.values()] == [ran.sandbox_id]
    assert len(agent.pools.after_answer) == 1
    gate.set()
    wait_for(lambda: not world.docker.containers)
    wait_for(lambda: not agent.pools.after_answer)
    assert [event for event, _ in world.journal.events()] == [
        "sandbox_created",
        "exec",
        "sandbox_destroyed",
    ]
    assert world.sandboxes.busy() == frozenset()


@pytest.mark.parametrize("ttl", [86400 + 1, 10**12, 10**40])
def test_a_deadline_past_the_maximum_is_refused_by_code_never_a_crash(
    agent: Agent, ttl: int
) -> None:
    client = Client(agent.socket)
    box = client.create(CreateSandbox(project="web", ttl_seconds=86400))  # the maximum is fine
    asks: list[Callable[[], object]] = [
        lambda: client.create(CreateSandbox(project="web", ttl_seconds=ttl)),
        lambda: client.run(
            RunRequest(sandbox=CreateSandbox(project="web", ttl_seconds=ttl), exec=EXEC)
        ),
        lambda: client.extend(box.id, Extend(ttl_seconds=ttl)),
    ]
    for ask in asks:
        with pytest.raises(errors.InvalidRequest) as caught:  # 400, the caller's to fix
            ask()
        assert (caught.value.code, caught.value.field) == ("ttl_too_long", "ttl_seconds")
        assert "maximum of 86400 seconds (24 h)" in caught.value.message
    assert client.get(box.id).expires_at == box.expires_at
    assert [view.id for view in client.list_sandboxes()] == [box.id]
    client.destroy(box.id)


def test_a_create_cannot_ask_for_a_pool_member_the_reaper_would_destroy(agent: Agent) -> None:
    client = Client(agent.socket)
    asks = [
        ("/sandboxes", {"project": "web", "pool": True}, "pool"),
        (
            "/run",
            {"sandbox": {"project": "web", "pool": True}, "exec": {"argv": ["x"]}},
            "sandbox.pool",
        ),
    ]
    for path, body, field in asks:
        with pytest.raises(errors.InvalidRequest) as caught:
            client.request("POST", path, body)
        assert (caught.value.code, caught.value.field) == ("invalid_field", field)
    assert client.list_sandboxes() == []
    box = client.create(WEB)
    client.reap(ReapRequest())  # a pass used to destroy a pool member as surplus (size 0)
    assert [view.id for view in client.list_sandboxes()] == [box.id]
    client.destroy(box.id)


def test_bytes_go_both_ways_exactly(agent: Agent) -> None:
    client = Client(agent.socket)
    box = client.create(WEB)
    odd = bytes([0xFB, 0xFF, 0xFE, 0x3E, 0x3F])  # base64url "-__-Pj8=": '-', '_' and padding
    run = agent.script((OUT, odd), (ERR, b"\0err"))
    result = client.exec(box.id, ExecRequest(argv=("cat",), stdin=odd))
    assert (run.stdin, result.stdout, result.stderr) == (odd, odd, b"\0err")
    client.destroy(box.id)


def test_a_mebibyte_of_stdin_fits_and_too_much_is_refused_by_code(agent: Agent) -> None:
    client = Client(agent.socket)
    box = client.create(WEB)
    big = os.urandom(1024 * 1024)
    run = agent.script()
    client.exec(box.id, ExecRequest(argv=("cat",), stdin=big))
    assert run.stdin == big
    with pytest.raises(errors.InvalidRequest) as caught:
        client.exec(box.id, ExecRequest(argv=("cat",), stdin=big * 4))
    assert caught.value.code == "body_too_large"
    assert "workspace" in caught.value.message
    client.destroy(box.id)


def test_a_shell_command_round_trips(agent: Agent) -> None:
    client = Client(agent.socket)
    box = client.create(WEB)
    run = agent.script()
    client.exec(box.id, ExecRequest(shell=True, argv="echo $HOME | wc -c"))
    assert run.request is not None
    assert run.request.argv == ("sh", "-c", "echo $HOME | wc -c")
    client.destroy(box.id)


@pytest.mark.parametrize(
    ("spec", "kind", "code"),
    [
        (CreateSandbox(project="web", memory="lots"), errors.InvalidLimit, "invalid_limit"),
        (CreateSandbox(project="web", memory="64GB"), errors.AdmissionRefused, "admission_refused"),
        (CreateSandbox(project="bad/name"), errors.InvalidName, "invalid_name"),
        # A code no class declares arrives as its status's branch, the code kept exact.
        (CreateSandbox(project="web", privileged=True), errors.InvalidRequest, "policy_privileged"),
    ],
)
def test_the_envelope_code_picks_the_error_class(
    agent: Agent, spec: CreateSandbox, kind: type[errors.SliceboxError], code: str
) -> None:
    with pytest.raises(kind) as caught:
        Client(agent.socket).create(spec)
    assert type(caught.value) is kind
    assert caught.value.code == code
    assert caught.value.message


def test_errors_keep_code_message_and_field(agent: Agent) -> None:
    client = Client(agent.socket)
    with pytest.raises(errors.NotFound) as missing:
        client.get("sbx-nothing")
    assert missing.value.code == "not_found"
    assert "sbx-nothing" in missing.value.message
    with pytest.raises(errors.InvalidRequest) as bad:
        client.request("POST", "/sandboxes", {"project": "web", "colour": "red"})
    assert (bad.value.code, bad.value.field) == ("invalid_field", "colour")


def test_every_class_is_found_by_its_own_code_and_unknown_codes_by_status() -> None:
    for kind in wire._tree(errors.SliceboxError):
        assert wire.error_class(kind.code, kind.http_status) is kind
    assert wire.error_class("from_a_newer_agent", 404) is errors.NotFound
    assert wire.error_class("from_a_newer_agent", 503) is errors.Unavailable
    assert wire.error_class("body_too_large", 413) is errors.InvalidRequest
    assert wire.error_class("from_a_newer_agent", 409) is errors.SliceboxError  # two own 409
    assert wire.error_class("from_a_newer_agent", 500) is errors.SliceboxError


def _use_and_fail(socket: str) -> None:
    with Client(socket) as client:
        client.create(WEB)
        kept = client.create(WEB)
        client.destroy(kept.id)
        client.create(WEB)
        raise RuntimeError("the caller failed")


def test_the_context_manager_destroys_what_it_made_and_no_more(agent: Agent) -> None:
    outside = Client(agent.socket).create(WEB)
    with pytest.raises(RuntimeError, match="the caller failed"):
        _use_and_fail(agent.socket)
    assert agent.sandboxes() == [outside.id]
    Client(agent.socket).destroy(outside.id)


def test_a_stream_gives_chunks_as_produced_then_the_result(agent: Agent) -> None:
    client = Client(agent.socket)
    box = client.create(WEB)
    agent.script((OUT, b"one\n"), (ERR, b"two\n"), (OUT, b"three\n"), exit_code=5)
    events = list(client.exec_stream(box.id, ExecRequest(argv=("x",))))
    assert events[:-1] == [
        StreamChunk(stream=OUT, data=b"one\n"),
        StreamChunk(stream=ERR, data=b"two\n"),
        StreamChunk(stream=OUT, data=b"three\n"),
    ]
    assert isinstance(events[-1], ExecResult)
    assert events[-1].exit_code == 5
    with pytest.raises(errors.NotFound):
        next(client.exec_stream("sbx-nothing", ExecRequest(argv=("x",))))
    client.destroy(box.id)


def test_a_streamed_run_gives_chunks_then_its_run_result_both_clients(agent: Agent) -> None:
    run = RunRequest(sandbox=WEB, exec=ExecRequest(argv=("x",)))
    agent.script((OUT, b"one\n"), (ERR, b"two\n"), exit_code=5)
    events = list(Client(agent.socket).run_stream(run))
    assert events[:-1] == [
        StreamChunk(stream=OUT, data=b"one\n"),
        StreamChunk(stream=ERR, data=b"two\n"),
    ]
    last = events[-1]
    assert isinstance(last, RunResult)
    assert (last.result.exit_code, last.result.stdout) == (5, b"one\n")
    assert last.usage is not None

    async def streamed() -> list[StreamChunk | RunResult]:
        async with AsyncClient(agent.socket) as client:
            return [e async for e in client.run_stream(run)]

    agent.script((OUT, b"a"), exit_code=0)
    got = asyncio.run(streamed())
    assert got[0] == StreamChunk(stream=OUT, data=b"a")
    assert isinstance(got[-1], RunResult)
    wait_for(lambda: Client(agent.socket).list_sandboxes() == [])


def _endless(agent: Agent) -> None:
    """An exec that prints more than any buffer holds, until it is killed."""
    run = agent.script(*[(OUT, b"y" * 65536)] * 1000)
    agent.world.host.procs[run.pid] = 100


def test_an_abandoned_stream_closes_and_the_agent_kills_the_command(agent: Agent) -> None:
    client = Client(agent.socket)
    box = client.create(WEB)
    _endless(agent)
    events = client.exec_stream(box.id, ExecRequest(argv=("yes",), output_cap=MAX_OUTPUT_CAP))
    assert isinstance(next(events), StreamChunk)
    events.close()
    wait_for(lambda: agent.world.host.kill_calls)
    assert agent.world.exec_api.run.closed
    client.destroy(box.id)


def test_a_caller_that_hangs_up_mid_stream_leaves_one_abandoned_record(agent: Agent) -> None:
    client = Client(agent.socket)
    box = client.create(WEB)
    _endless(agent)
    body = ExecRequest(argv=("yes",), output_cap=MAX_OUTPUT_CAP).model_dump_json().encode()
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(agent.socket)
        conn.sendall(
            f"POST /v1/sandboxes/{box.id}/exec/stream HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b'"stream":"stdout"' not in received:
            received += conn.recv(65536)
    wait_for(lambda: [e for e in agent.world.journal.events() if e[0] == "exec"])
    wait_for(lambda: agent.world.budget.in_use == 0)
    client.destroy(box.id)
    assert [e for e in agent.world.journal.events() if e[0] == "exec"] == [("exec", "abandoned")]


def test_a_full_budget_answers_503_busy_and_a_stream_holds_its_share(tmp_path: Path) -> None:
    request = ExecRequest(argv=("yes",), output_cap=MAX_OUTPUT_CAP)
    world = World(tmp_path, budget=OutputBudget.fixed(exec_reservation(MAX_OUTPUT_CAP)))
    with served(tmp_path, world) as agent:
        client = Client(agent.socket)
        box = client.create(WEB)
        _endless(agent)
        events = client.exec_stream(box.id, request)
        assert isinstance(next(events), StreamChunk)
        assert world.budget.in_use == exec_reservation(MAX_OUTPUT_CAP)
        with pytest.raises(errors.Unavailable) as caught:
            client.exec(box.id, ExecRequest(argv=("x",), output_cap=1))
        answer = raw_request(agent.socket, f"/v1/sandboxes/{box.id}/exec", request)
        events.close()
        wait_for(lambda: world.budget.in_use == 0)
        client.destroy(box.id)
    assert caught.value.code == "busy"
    assert "retry later, or ask for a smaller output_cap" in caught.value.message
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert b'"code": "busy"' in answer
    refused = [e for e in world.journal.events() if e[0] == "request_refused"]
    assert refused == [("request_refused", "busy")] * 2


def raw_request(path: str, route: str, body: ExecRequest) -> bytes:
    data = body.model_dump_json().encode()
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(path)
        conn.sendall(
            f"POST {route} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        return b"".join(iter(lambda: conn.recv(65536), b""))


def test_no_agent_and_a_silent_agent_are_unavailable(tmp_path: Path) -> None:
    with pytest.raises(errors.Unavailable) as caught:
        Client(str(tmp_path / "none.sock")).health()
    assert caught.value.code == "agent_unreachable"
    with bind_unix(tmp_path / "silent.sock", group=None), pytest.raises(errors.Unavailable) as mute:
        Client(str(tmp_path / "silent.sock"), timeout=0.5).health()
    assert mute.value.code == "agent_no_answer"


# --- asyncio ---------------------------------------------------------------------------------


def test_async_routes_errors_and_stream(agent: Agent) -> None:
    async def scenario() -> None:
        async with AsyncClient(agent.socket) as client:
            assert (await client.health()).admin is True
            box = await client.create(WEB)
            assert [v.id for v in await client.list_sandboxes()] == [box.id]
            agent.script((OUT, b"\xfb\xff"), (ERR, b"e"), exit_code=4)
            events = [e async for e in client.exec_stream(box.id, ExecRequest(argv=("x",)))]
            assert events[0] == StreamChunk(stream=OUT, data=b"\xfb\xff")
            assert isinstance(events[-1], ExecResult)
            assert events[-1].exit_code == 4
            with pytest.raises(errors.InvalidLimit):
                await client.create(CreateSandbox(project="web", memory="lots"))
            with pytest.raises(errors.NotFound):
                await client.exec("sbx-nothing", ExecRequest(argv=("x",)))
            assert (await client.destroy(box.id)).destroyed is True

    asyncio.run(scenario())


def test_async_context_manager_destroys_what_it_made(agent: Agent) -> None:
    async def scenario() -> None:
        async with AsyncClient(agent.socket) as client:
            await asyncio.gather(*(client.create(WEB) for _ in range(3)))
            assert len(agent.sandboxes()) == 3

    asyncio.run(scenario())
    assert agent.sandboxes() == []


def test_async_abandoned_stream_closes_and_the_agent_kills_the_command(agent: Agent) -> None:
    async def scenario() -> None:
        async with AsyncClient(agent.socket) as client:
            box = await client.create(WEB)
            _endless(agent)
            request = ExecRequest(argv=("yes",), output_cap=MAX_OUTPUT_CAP)
            async with aclosing(client.exec_stream(box.id, request)) as events:
                assert isinstance(await anext(events), StreamChunk)
            await asyncio.to_thread(wait_for, lambda: agent.world.host.kill_calls)
            await client.destroy(box.id)

    asyncio.run(scenario())
    assert agent.world.exec_api.run.closed


def test_async_no_agent_and_a_silent_agent_are_unavailable(tmp_path: Path) -> None:
    async def call(path: Path, timeout: float) -> None:
        async with AsyncClient(str(path), timeout=timeout) as client:
            await client.health()

    with pytest.raises(errors.Unavailable) as caught:
        asyncio.run(call(tmp_path / "none.sock", 5))
    assert caught.value.code == "agent_unreachable"
    with bind_unix(tmp_path / "silent.sock", group=None), pytest.raises(errors.Unavailable) as mute:
        asyncio.run(call(tmp_path / "silent.sock", 0.5))
    assert mute.value.code == "agent_no_answer"


def test_the_clients_old_names_stay_for_one_release() -> None:
    import slicebox.cli.asyncclient
    import slicebox.cli.client

    assert slicebox.cli.client.Client is Client
    assert slicebox.cli.asyncclient.AsyncClient is AsyncClient


def test_the_sync_client_alone_does_not_import_asyncio() -> None:
    """The CLI imports ``slicebox.client`` for ``Client``: ``AsyncClient`` (asyncio, the async
    HTTP client) comes only when asked for."""
    script = (
        "import sys\nfrom slicebox.client import Client\n"
        "print(sorted(m for m in ('asyncio', 'slicebox.client.aio', 'slicebox.web.client') "
        "if m in sys.modules))\n"
        "from slicebox.client import AsyncClient\nprint('slicebox.client.aio' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split("\n")[:2] == ["[]", "True"]
