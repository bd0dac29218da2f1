"""A create's progress through the agent's real app and clients, over the fake Docker: the
streamed create and run tell a pull as it goes, the plain calls are unchanged; concurrent
creates of one image make one pull; a registry's failure is ``image_pull_failed``; the CLI shows
a bar on a terminal, plain lines in a pipe and nothing with ``--json`` or ``-q``."""

from __future__ import annotations

import asyncio
import io
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.cli import main as cli
from slicebox.cli.progress import Bars, Bytes, Lines, shown
from slicebox.client import AsyncClient, Client
from slicebox.core.blocking import core_loop
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.errors import ImagePullFailed, ImageUnavailable, SliceboxError
from slicebox.model.exec import ExecRequest, OutputStream, StreamChunk
from slicebox.model.progress import LayerProgress, Phase, ProgressEvent
from tests.fakes.docker import LAYER
from tests.unit.agentserver import Agent, served, wait_for
from tests.unit.test_cli import Stdin
from tests.unit.test_service import World

IMAGE = "localhost:5000/slicebox-test/big:1"
Fd = pytest.CaptureFixture[bytes]


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    monkeypatch.setattr(sys, "stdin", Stdin())
    with served(tmp_path) as running:
        running.world.docker.registry.add(IMAGE)
        yield running
        assert running.sandboxes() == [], "a test left a sandbox behind"


def spec(image: str = IMAGE) -> CreateSandbox:
    return CreateSandbox(project="web", image=image)


def test_a_streamed_create_tells_the_pull_up_to_its_total_then_answers_the_sandbox(
    agent: Agent,
) -> None:
    events: list[ProgressEvent] = []
    client = Client(agent.socket)
    view = client.create_stream(spec(), events.append)
    pulled = [event for event in events if event.phase is Phase.PULLING]
    assert pulled[-1].done == pulled[-1].total == LAYER
    assert pulled[-1].layers[0].current == LAYER
    assert events[-1].phase is Phase.STARTING
    assert agent.world.docker.pulls == [IMAGE]
    client.destroy(view.id)


def test_the_plain_create_is_unchanged(agent: Agent) -> None:
    client = Client(agent.socket)
    view = client.create(spec())
    assert agent.world.docker.pulls == [IMAGE]
    client.destroy(view.id)


def test_four_concurrent_creates_of_one_image_make_one_pull(agent: Agent) -> None:
    gate = asyncio.Event()
    agent.world.docker.pull_gate = gate
    seen: list[list[ProgressEvent]] = [[] for _ in range(4)]
    made: list[str] = []

    def create(n: int) -> None:
        made.append(Client(agent.socket).create_stream(spec(), seen[n].append).id)

    threads = [threading.Thread(target=create, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    while sum(1 for events in seen if events) < 4:  # each is told where the one pull stands
        threading.Event().wait(0.01)
    core_loop().call_soon_threadsafe(gate.set)
    for thread in threads:
        thread.join(30)
    assert len(made) == 4
    assert agent.world.docker.pulls == [IMAGE]
    client = Client(agent.socket)
    for box in made:
        client.destroy(box)


def test_a_registry_s_failure_is_image_pull_failed_and_leaves_nothing(agent: Agent) -> None:
    agent.world.docker.pull_error = ImagePullFailed("the pull of image x failed: EOF")
    client = Client(agent.socket)
    with pytest.raises(ImagePullFailed) as caught:
        client.create(spec())
    assert caught.value.code == "image_pull_failed"
    events: list[ProgressEvent] = []
    with pytest.raises(ImagePullFailed):  # after progress: the stream's last line says it
        client.create_stream(spec(), events.append)
    assert events
    with pytest.raises(ImageUnavailable):  # nothing to pull: as before
        client.create(spec("nowhere/none:1"))


def test_a_streamed_run_tells_the_pull_before_the_output(agent: Agent) -> None:
    events: list[ProgressEvent] = []
    request = RunRequest(sandbox=spec(), exec=ExecRequest(argv=("x",)))

    async def main() -> list[object]:
        async with AsyncClient(agent.socket) as client:
            return [event async for event in client.run_stream(request, events.append)]

    agent.script((OutputStream.STDOUT, b"out"))
    got = asyncio.run(main())
    assert got[0] == StreamChunk(stream=OutputStream.STDOUT, data=b"out")
    assert [event.phase for event in events][-1] is Phase.STARTING
    assert any(event.done == LAYER for event in events)


def test_a_streamed_run_of_an_image_present_says_nothing_of_its_start(agent: Agent) -> None:
    events: list[ProgressEvent] = []
    request = RunRequest(sandbox=spec("alpine:3.19"), exec=ExecRequest(argv=("x",)))
    list(Client(agent.socket).run_stream(request, events.append))
    assert events == []


# --- the CLI ----------------------------------------------------------------------------------


def slicebox(agent: Agent, *argv: str) -> int:
    return cli.main(["--socket", agent.socket, *argv])


def test_a_piped_create_shows_plain_lines_and_the_id_alone_on_stdout(
    agent: Agent, capfdbinary: Fd
) -> None:
    assert slicebox(agent, "create", "--project", "web", "--image", IMAGE) == 0
    written = capfdbinary.readouterr()
    box = written.out.decode().strip()
    lines = written.err.decode().splitlines()
    assert lines[-2] == f"pulling {IMAGE}: 24 MiB of 24 MiB, 1/1 layers"
    assert lines[-1] == f"starting {IMAGE}"
    assert "\r" not in written.err.decode()
    assert slicebox(agent, "-q", "rm", box) == 0


@pytest.mark.parametrize("flag", ["--json", "-q"])
def test_json_and_quiet_show_nothing_extra(agent: Agent, capfdbinary: Fd, flag: str) -> None:
    assert slicebox(agent, flag, "create", "--project", "web", "--image", IMAGE) == 0
    written = capfdbinary.readouterr()
    assert written.err == b""
    client = Client(agent.socket)
    for each in client.list_sandboxes():
        client.destroy(each.id)


def test_a_create_of_an_image_present_shows_nothing(agent: Agent, capfdbinary: Fd) -> None:
    assert slicebox(agent, "create", "--project", "web") == 0
    written = capfdbinary.readouterr()
    assert written.err == b""
    assert slicebox(agent, "rm", written.out.decode().strip()) == 0


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def pulling(done: int) -> ProgressEvent:
    layer = LayerProgress(id="l1", status="Downloading", current=done, total=LAYER)
    return ProgressEvent(
        phase=Phase.PULLING, subject=IMAGE, done=done, total=LAYER, layers=(layer,)
    )


def test_a_terminal_gets_a_bar_and_a_pipe_gets_lines() -> None:
    terminal, pipe = Terminal(), io.StringIO()
    assert isinstance(shown(quiet=False, out=terminal), Bars)
    assert isinstance(shown(quiet=False, out=pipe), Lines)
    bars = Bars(terminal)
    for done in (0, LAYER // 2, LAYER):
        bars.event(pulling(done))
    bars.event(ProgressEvent(phase=Phase.STARTING, subject=IMAGE))
    bars.close()
    drawn = terminal.getvalue()
    assert drawn.endswith(f"starting {IMAGE}\n")
    assert "\r" in drawn
    assert "100%" in drawn
    assert "24.0M/24.0M" in drawn


def test_plain_lines_come_at_most_once_a_second_and_at_the_end() -> None:
    now = [0.0]
    out = io.StringIO()
    lines = Lines(out, clock=lambda: now[0])
    for step in range(10):
        now[0] = step * 0.3
        lines.event(pulling(LAYER * step // 10))
    lines.event(pulling(LAYER))
    said = out.getvalue().splitlines()
    assert len(said) == 4  # at 0, 1.2 and 2.4 s, and the end
    assert said[-1].endswith("24 MiB of 24 MiB, 1/1 layers")


def test_a_copy_that_goes_on_shows_its_bytes_in_lines_and_a_short_one_nothing() -> None:
    now = [0.0]
    out = io.StringIO()
    copying = Bytes("./big -> sbx-1:/workspace", quiet=False, out=out, clock=lambda: now[0])
    for step in range(1, 6):
        now[0] = step * 0.5
        list(copying.counted([b"x" * (1 << 20)]))
    copying.done()
    said = out.getvalue().splitlines()
    assert said[0] == "./big -> sbx-1:/workspace: 2 MiB"
    assert said[-1] == "./big -> sbx-1:/workspace: 5 MiB, done"
    short, quiet = io.StringIO(), io.StringIO()
    for where, be_quiet in ((short, False), (quiet, True)):
        small = Bytes("x", quiet=be_quiet, out=where, clock=lambda: 0.0)
        list(small.counted([b"x"] * 3))
        small.done()
    assert short.getvalue() == quiet.getvalue() == ""


def test_a_caller_gone_mid_pull_leaks_neither_the_pull_nor_a_thread(agent: Agent) -> None:
    gate = asyncio.Event()
    agent.world.docker.pull_gate = gate
    body = spec().model_dump_json(exclude_none=True).encode()
    client = Client(agent.socket)
    client.destroy(client.create(spec("alpine:3.19")).id)  # the calls pool has its threads
    before = threading.active_count()
    with socket.socket(socket.AF_UNIX) as caller:
        caller.connect(agent.socket)
        caller.sendall(
            b"POST /v1/sandboxes/stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        said = b""
        while b'{"progress": ' not in said:  # the pull has begun; then the caller leaves
            said += caller.recv(65536)
    assert agent.world.docker.pulls == [IMAGE]
    core_loop().call_soon_threadsafe(gate.set)
    # A create runs to its end (what it made is never half made): its sandbox is there.
    wait_for(lambda: bool(client.list_sandboxes()))
    threads = threading.active_count()
    for each in client.list_sandboxes():
        client.destroy(each.id)
    assert threads <= before + 1  # the core loop's, at most
    assert agent.world.docker.pulls == [IMAGE]


def test_distinct_pulls_past_pulls_in_flight_wait_for_none_and_are_refused_pulls_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the agent's app: a pull in flight holds its slot of [shares] pulls_in_flight
    (root, the caller here, is bound by the total only), so a create of another image is
    refused pulls_busy at once instead of waiting behind a slow registry."""
    monkeypatch.setattr(sys, "stdin", Stdin())
    other = "localhost:5000/slicebox-test/other:1"
    world = World(tmp_path, config="[shares]\npulls_in_flight = 1\n")
    with served(tmp_path, world) as agent:
        agent.world.docker.registry |= {IMAGE, other}
        gate = asyncio.Event()
        agent.world.docker.pull_gate = gate
        made: list[str] = []
        first = threading.Thread(target=lambda: made.append(Client(agent.socket).create(spec()).id))
        first.start()
        wait_for(lambda: agent.world.docker.pulls == [IMAGE])
        client = Client(agent.socket)
        with pytest.raises(SliceboxError) as caught:
            client.create(spec(other))
        assert caught.value.code == "pulls_busy"
        core_loop().call_soon_threadsafe(gate.set)
        first.join(30)
        assert agent.world.docker.pulls == [IMAGE], "the refused create pulled nothing"
        for box in made:
            client.destroy(box)
