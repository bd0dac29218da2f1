from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import pytest

from slicebox.client import Client
from slicebox.core.expiry import Result
from slicebox.host.journal import Auditor
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.errors import SliceboxError, Unavailable
from slicebox.model.exec import ExecRequest
from slicebox.server import daemon
from slicebox.server.api import base_routes
from slicebox.server.daemon import Agent, watchdog_interval
from slicebox.server.routes import ROUTES
from slicebox.server.state import SERVICE
from tests.unit.agentserver import AnyContainer
from tests.unit.test_client import slow_removals
from tests.unit.test_service import World


class Notes:
    def __init__(self) -> None:
        self.states: list[str] = []

    def notify(self, state: str) -> None:
        self.states.append(state)

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the agent said READY: it answers, and its signal handlers are in place (the
        socket's file exists a moment before it listens, and a SIGTERM then kills the tests)."""
        deadline = time.monotonic() + timeout
        while not any(s.startswith("READY=1") for s in self.states):
            if time.monotonic() > deadline:
                raise AssertionError(f"the agent was not ready within {timeout}s")
            time.sleep(0.02)


class Journal:
    def __init__(self) -> None:
        self.events: list[str] = []

    def send(self, fields: Mapping[str, str]) -> None:
        self.events.append(fields["SLICEBOX_EVENT"])


def test_watchdog_interval_is_half_of_watchdog_sec_for_us_only() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "20000000"}, 7) == 10.0
    assert watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "7"}, 7) == 10.0
    assert watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "8"}, 7) is None
    assert watchdog_interval({}, 7) is None


def test_agent_serves_reloads_and_stops_on_signals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agent.sock"
    notes, journal = Notes(), Journal()
    # The collector paused while the agent started (slicebox.host.lean) resumes once it is READY.
    resumed: list[list[str]] = []
    monkeypatch.setattr(daemon, "started", lambda: resumed.append(list(notes.states)))
    reloads: list[int] = []

    async def reload() -> str:
        reloads.append(1)
        return "configuration reloaded (test)"

    health: list[str] = []

    def drive() -> None:
        # Whatever happens here, the agent is told to stop: a failed step must fail the
        # test, not hang it (a loaded machine can be slow to bind).
        try:
            deadline = time.monotonic() + 60
            notes.wait_ready()
            health.append(Client(str(path), timeout=60).request("GET", "/health")["status"])
            os.kill(os.getpid(), signal.SIGHUP)
            while not reloads and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    driver = threading.Thread(target=drive)
    driver.start()
    asyncio.run(Agent(base_routes(), notes, Auditor(journal), reload).run(path))
    driver.join()
    assert health == ["ok"]
    assert notes.states[0].startswith("READY=1")
    assert len(resumed) == 1
    assert [state[:7] for state in resumed[0]] == ["READY=1"]
    assert any("configuration reloaded (test)" in state for state in notes.states)
    assert notes.states[-1].startswith("STOPPING=1")
    assert journal.events == ["agent_started", "agent_stopping"]


def test_a_graceful_stop_waits_for_the_removals_runs_left_after_their_answers(
    tmp_path: Path,
) -> None:
    world = World(tmp_path)
    world.exec_api.containers = AnyContainer()
    gate, notes = slow_removals(world), Notes()
    path = tmp_path / "agent.sock"
    answers: list[bytes] = []

    def drive() -> None:
        try:
            notes.wait_ready()
            run = RunRequest(sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",)))
            answers.append(Client(str(path), timeout=60).run(run).result.stdout)
            assert world.docker.containers, "answered before the removal"
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Timer(0.3, gate.set).start()  # Docker removes it a while into the stop

    driver = threading.Thread(target=drive)
    driver.start()
    agent = Agent(ROUTES, notes, Auditor(Journal()), state={SERVICE: world.service})
    asyncio.run(agent.run(path))
    driver.join()
    assert answers == [b"hi\n"]
    assert world.docker.containers == {}, "the stop waited for the removal"
    assert [event for event, _ in world.journal.events()][-1] == "sandbox_destroyed"
    assert world.sandboxes.busy() == frozenset()


class StubExpiry:
    def __init__(self, error: SliceboxError | None = None) -> None:
        self.error = error
        self.calls: list[tuple[str, str, datetime | None]] = []

    def expire(self, sandbox_id: str, container_id: str, deadline: datetime | None) -> Result:
        self.calls.append((sandbox_id, container_id, deadline))
        if self.error is not None:
            raise self.error
        return Result.GONE


def test_expire_is_a_command_of_sliceboxd_that_needs_no_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a deadline timer runs: the same program, no socket, no agent; 0 unless it failed."""
    stub = StubExpiry()
    monkeypatch.setattr(daemon, "assemble_expiry", lambda auditor: stub)
    assert daemon.main(["expire", "sbx-1", "c1", "--deadline", "1767323045"]) == 0
    assert daemon.main(["expire", "sbx-1", "c1"]) == 0
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert stub.calls == [("sbx-1", "c1", at), ("sbx-1", "c1", None)]
    failing = StubExpiry(Unavailable("systemd is not reachable"))
    monkeypatch.setattr(daemon, "assemble_expiry", lambda auditor: failing)
    assert daemon.main(["expire", "sbx-1", "c1"]) == 1
