"""The exec output budget: shared by concurrent execs, refused at once when full, always given
back, and large enough for what answering an exec really holds."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from slicebox.core.budget import OutputBudget, exec_reservation
from slicebox.core.execoutput import OutputCapture
from slicebox.core.shares import Reservation
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.errors import InvalidRequest, SandboxNotRunning, Unavailable
from slicebox.model.exec import ExecRequest, ExecResult, OutputStream, StreamChunk
from slicebox.server.api import json_ok
from slicebox.server.routes import _line
from slicebox.web.response import Response
from tests.fakes.threadside import ThreadSide
from tests.unit.test_service import ALICE, World

MiB = 1024 * 1024
CAP = 1000
ONE = exec_reservation(CAP)


def test_concurrent_reservations_over_the_budget_are_refused_busy_at_once() -> None:
    budget = OutputBudget.fixed(3 * ONE)
    start, held = threading.Barrier(8), threading.Event()
    got: list[Reservation] = []
    refused: list[Unavailable] = []

    def one() -> None:
        start.wait()
        try:
            got.append(budget.reserve(CAP))
        except Unavailable as exc:
            refused.append(exc)
        held.wait()

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    while len(got) + len(refused) < 8:
        threading.Event().wait(0.01)
    assert (len(got), len(refused), budget.in_use) == (3, 5, 3 * ONE)
    assert {exc.code for exc in refused} == {"busy"}
    assert refused[0].message == (
        "the agent is busy: execs in flight (3) hold 35.2 KiB of its 35.2 KiB exec output "
        "budget and this exec needs 11.7 KiB; retry later, or ask for a smaller output_cap"
    )
    held.set()
    for thread in threads:
        thread.join(10)
    for reservation in got:
        reservation.release()
    assert budget.in_use == 0
    budget.reserve(CAP).release()  # room again


def test_a_cap_no_idle_agent_could_hold_is_invalid_not_busy() -> None:
    budget = OutputBudget.fixed(10 * MiB)
    with pytest.raises(InvalidRequest) as caught:
        budget.reserve(16 * MiB)
    assert (caught.value.code, caught.value.field) == ("output_cap_over_budget", "output_cap")
    largest = int(caught.value.message.rsplit("at most ", 1)[1].split()[0])
    budget.reserve(largest).release()
    assert budget.in_use == 0


def test_a_reservation_is_given_back_once_and_the_limit_is_read_each_time() -> None:
    limit = [ONE]
    budget = OutputBudget(lambda: limit[0])
    with budget.reserve(CAP) as reservation:
        assert budget.in_use == ONE
    reservation.release()
    assert budget.in_use == 0
    limit[0] = ONE - 1  # a reload shrank it
    with pytest.raises(InvalidRequest):
        budget.reserve(CAP)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(json_ok, id="blocking"),
        pytest.param(_line, id="stream's final line"),
    ],
)
def test_the_reservation_covers_what_answering_an_exec_holds(
    answer: Callable[[ExecResult], object],
) -> None:
    cap = 1 * MiB
    gc.collect()
    tracemalloc.start()
    try:
        capture = OutputCapture(cap)
        for stream in OutputStream:
            for _ in range(cap // 65536 + 2):
                capture.add(StreamChunk(stream=stream, data=b"y" * 65536))
        result = capture.result(exit_code=0, timed_out=False, oom_killed=False, duration=1)
        sent = answer(result)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(sent, Response | bytes)
    assert 2 * cap < peak <= exec_reservation(cap)


# --- the service holds and gives back ------------------------------------------------------


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, budget=OutputBudget.fixed(2 * ONE))


def test_an_exec_gives_its_share_back_when_it_ends_or_fails(world: World) -> None:
    box = world.create(ALICE)
    ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("x",), output_cap=CAP))
    assert world.budget.in_use == 0
    world.docker.stop(ThreadSide(world.service).get(ALICE, box).container_id)
    with pytest.raises(SandboxNotRunning):
        ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("x",), output_cap=CAP))
    assert world.budget.in_use == 0


def test_a_stream_holds_its_share_until_it_is_abandoned(world: World) -> None:
    box = world.create(ALICE)
    world.run.script = [[StreamChunk(stream=OutputStream.STDOUT, data=b"y")]] * 5
    world.host.procs[world.run.pid] = 100
    events = ThreadSide(world.service).exec_stream(
        ALICE, box, ExecRequest(argv=("yes",), output_cap=CAP)
    )
    next(events)
    assert world.budget.in_use == ONE
    events.close()
    assert world.budget.in_use == 0


def test_a_busy_exec_is_refused_and_audited(world: World) -> None:
    box = world.create(ALICE)
    with world.budget.reserve(2 * CAP):
        with pytest.raises(Unavailable) as caught:
            ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("x",), output_cap=CAP))
        with pytest.raises(Unavailable):
            next(
                ThreadSide(world.service).exec_stream(
                    ALICE, box, ExecRequest(argv=("x",), output_cap=CAP)
                )
            )
    assert caught.value.code == "busy"
    refusals = [e for e in world.journal.entries if e["SLICEBOX_EVENT"] == "request_refused"]
    assert [(e["SLICEBOX_RESULT"], e["SLICEBOX_SANDBOX_ID"]) for e in refusals] == [
        ("busy", box),
        ("busy", box),
    ]
    assert refusals[0]["SLICEBOX_DETAIL"].startswith("exec refused: the agent is busy")
    assert world.run.request is None, "nothing ran"


def test_a_busy_run_creates_nothing_and_a_run_reserves_once(world: World) -> None:
    run = RunRequest(sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",)))
    tight = run.model_copy(update={"exec": ExecRequest(argv=("x",), output_cap=2 * CAP)})
    with world.budget.reserve(CAP), pytest.raises(Unavailable):
        ThreadSide(world.service).run(ALICE, tight)
    assert world.journal.events() == [("request_refused", "busy")]
    assert world.journal.entries[0]["SLICEBOX_DETAIL"].startswith("run refused:")
    assert (
        ThreadSide(world.service).run(ALICE, tight).result.exit_code == 0
    )  # the whole budget, once
    assert world.budget.in_use == 0
    assert [event for event, _ in world.journal.events()[1:]] == [
        "sandbox_created",
        "exec",
        "sandbox_destroyed",
    ]
