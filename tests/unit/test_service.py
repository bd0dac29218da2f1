"""The agent's core over fakes: who may see and do what, and what the audit records."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from slicebox.core.blocking import Blocking, from_thread, inline
from slicebox.core.budget import OutputBudget
from slicebox.core.deadlines import Deadlines
from slicebox.core.execution import ExecEngine
from slicebox.core.launch import WAITER_COMMAND
from slicebox.core.nesting import InnerSockets
from slicebox.core.reaper import Reaper
from slicebox.core.sandboxes import KEEP_ALIVE, Sandbox, SandboxManager
from slicebox.core.service import Service
from slicebox.core.slices import SliceManager
from slicebox.core.telemetry import TreeReader, UsageReader, scope_pid
from slicebox.core.views import cgroups_of
from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.api import CreateSandbox, Extend, ReapRequest, RunRequest, RunResult
from slicebox.model.audit import AuditRecord
from slicebox.model.config import DEFAULT_EXEC_OUTPUT_BUDGET, ReaperConfig, parse_config
from slicebox.model.errors import Forbidden, NotFound, SandboxNotRunning
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult, OutputStream, StreamChunk
from tests.fakes.counting import counting
from tests.fakes.docker import FakeDocker
from tests.fakes.exec_fakes import FakeClock, FakeExec, FakeExecApi, FakeSandboxHost
from tests.fakes.journal import ListJournal
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import ThreadSide

MiB = 1024 * 1024
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
ALICE = Identity(uid=1000, gid=1000, pid=11, user_name="alice", is_admin=False)
BOB = Identity(uid=1001, gid=1001, pid=12, user_name="bob", is_admin=False)
ORCH = Identity(uid=1002, gid=1002, pid=13, user_name="orch", is_admin=True)
T = TypeVar("T")


class World:
    """An agent over fakes of Docker and systemd; ``after``: an agent started anew on the
    fakes (the host) of another, which knows of its sandboxes only what the host says."""

    def __init__(
        self,
        tmp: Path,
        budget: OutputBudget | None = None,
        *,
        after: World | None = None,
        config: str = "",
        inner: InnerSockets | None = None,
    ) -> None:
        self.systemd: FakeSystemd = after.systemd if after else FakeSystemd()
        clock, self.host = FakeClock(), FakeSandboxHost()
        self.run = FakeExec([[StreamChunk(stream=OutputStream.STDOUT, data=b"hi\n")], None])
        self.exec_api = FakeExecApi(clock, self.host, self.run)
        self.docker: FakeDocker = (
            after.docker if after else FakeDocker(self.systemd, execs=self.exec_api)
        )
        # Every call the agent makes to Docker and systemd, as "docker.find", "systemd.stop"...
        self.calls: Counter[str] = Counter()
        docker = counting(self.docker, self.calls, "docker")
        systemd = counting(self.systemd, self.calls, "systemd")
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        slices = SliceManager(systemd)
        self.sandboxes = SandboxManager(
            docker,
            slices,
            config=parse_config(config),
            host_memory=4096 * MiB,
            instance_id="run-1",
            clock=lambda: NOW,
            new_id=lambda: next(ids),
            deadlines=Deadlines(systemd),
            nested_root=tmp / "nested",
        )
        self.journal = ListJournal()
        self.budget = budget or OutputBudget.fixed(DEFAULT_EXEC_OUTPUT_BUDGET)

        def pid_of(sandbox: Sandbox) -> int | None:  # as server.runtime finds it
            return scope_pid(CgroupFS(tmp), cgroups_of(sandbox).scope)

        self.service = Service(
            self.sandboxes,
            ExecEngine(docker, self.host, clock=clock, asleep=clock.asleep),
            usage=UsageReader(CgroupFS(tmp)),
            tree=TreeReader(CgroupFS(tmp)),
            auditor=Auditor(self.journal),
            pid_of=pid_of,
            clock=lambda: NOW,
            budget=self.budget,
            reaper=Reaper(
                self.sandboxes,
                slices,
                docker,
                auditor=Auditor(self.journal),
                config=lambda: ReaperConfig(state_dir=tmp / "state"),
                clock=lambda: NOW,
            ),
            inner=inner,
        )

    def service_identity(self) -> Identity:
        return ORCH

    def create(self, who: Identity, user: str | None = None) -> str:
        return ThreadSide(self.service).create(who, CreateSandbox(user=user, project="web")).id


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_a_user_sees_only_its_own_sandboxes(world: World) -> None:
    mine = world.create(ALICE)
    assert ThreadSide(world.service).get(ALICE, mine).user == "alice"
    assert [v.id for v in ThreadSide(world.service).list_sandboxes(ALICE)] == [mine]
    assert ThreadSide(world.service).list_sandboxes(BOB) == []
    with pytest.raises(NotFound) as caught:
        ThreadSide(world.service).get(BOB, mine)
    with pytest.raises(NotFound) as unknown:
        ThreadSide(world.service).get(BOB, "sbx-nothing")
    assert caught.value.message.replace(mine, "X") == unknown.value.message.replace(
        "sbx-nothing", "X"
    ), "another user's sandbox must look exactly like a missing one"


def test_others_cannot_exec_in_or_destroy_my_sandbox(world: World) -> None:
    mine = world.create(ALICE)
    with pytest.raises(NotFound):
        ThreadSide(world.service).exec(BOB, mine, ExecRequest(argv=("id",)))
    assert ThreadSide(world.service).destroy(BOB, mine).destroyed is False
    assert ThreadSide(world.service).get(ALICE, mine).id == mine


def test_another_users_get_is_refused_before_systemd_is_asked(world: World) -> None:
    mine = world.create(ALICE)
    world.calls.clear()
    with pytest.raises(NotFound):
        ThreadSide(world.service).get(BOB, mine)
    assert not [call for call in world.calls if call.startswith("systemd.")], world.calls
    ThreadSide(world.service).get(ALICE, mine)
    assert [call for call in world.calls if call.startswith("systemd.")], "the owner's reads it"


def test_only_admins_act_for_other_users(world: World) -> None:
    with pytest.raises(Forbidden):
        world.create(ALICE, user="bob")
    assert ("request_refused", "forbidden") in world.journal.events()
    theirs = world.create(ORCH, user="bob")
    assert ThreadSide(world.service).get(BOB, theirs).user == "bob"
    assert {v.id for v in ThreadSide(world.service).list_sandboxes(ORCH)} == {theirs}


def test_every_action_is_audited_with_the_caller(world: World) -> None:
    box = world.create(ALICE)
    result = ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("echo", "hi")))
    assert result.stdout == b"hi\n"
    gone = ThreadSide(world.service).destroy(ALICE, box)
    assert gone.destroyed
    assert ThreadSide(world.service).destroy(ALICE, box).destroyed is False  # idempotent
    assert world.journal.events() == [
        ("sandbox_created", "ok"),
        ("exec", "ok"),
        ("sandbox_destroyed", "ok"),
    ]
    assert all(e["SLICEBOX_CALLER_UID"] == "1000" for e in world.journal.entries)
    assert world.journal.entries[1]["SLICEBOX_EXIT_CODE"] == "0"
    assert {e["SLICEBOX_SANDBOX_ID"] for e in world.journal.entries} == {box}


def test_a_destroy_costs_the_same_few_calls_however_many_sandboxes_exist(world: World) -> None:
    costs = []
    for _ in range(2):
        target = world.create(ALICE)
        world.calls.clear()
        assert ThreadSide(world.service).destroy(ALICE, target).destroyed
        costs.append(dict(world.calls))
        for _ in range(5):  # more sandboxes of the same user and project, and timers
            world.create(ALICE)
    assert (
        costs[0]
        == costs[1]
        == {
            # No look-up: the agent made the sandbox, and what a destroy reads never changes.
            "docker.remove": 1,
            "systemd.is_active": 1,  # its scope has stopped (its timer stops with it)
        }
    )


def test_a_destroy_through_the_socket_of_a_sandbox_the_agent_made_needs_no_look_up(
    world: World,
) -> None:
    """The route's destroy: what it needs of a sandbox this agent made (container, user,
    project, lineage) is in its labels, which never change, so no inspect goes to Docker;
    another user's sandbox is as absent as a missing one, and nothing of it is removed."""
    target = world.create(ALICE)
    world.calls.clear()
    assert on_loop(world.service.destroy(BOB, target, inline)).destroyed is False
    assert dict(world.calls) == {}
    done = on_loop(world.service.destroy(ALICE, target, inline))
    assert done.destroyed
    assert done.usage is not None
    assert dict(world.calls) == {
        "docker.remove": 1,
        "systemd.is_active": 1,
    }
    assert world.journal.events()[-1] == ("sandbox_destroyed", "ok")
    world.calls.clear()
    assert on_loop(world.service.destroy(ALICE, target, inline)).destroyed is False
    assert dict(world.calls) == {"docker.inspect": 1}, "forgotten with its removal"


def test_a_restarted_agent_looks_a_sandbox_up_on_the_loop_before_its_destroy(
    world: World, tmp_path: Path
) -> None:
    target = world.create(ALICE)
    restarted = World(tmp_path, after=world)
    assert on_loop(restarted.service.destroy(BOB, target, inline)).destroyed is False
    assert dict(restarted.calls) == {"docker.inspect": 1}
    restarted.calls.clear()
    assert on_loop(restarted.service.destroy(ALICE, target, inline)).destroyed
    assert restarted.calls["docker.inspect"] == 0, "known since the look-up before"
    assert restarted.calls["docker.remove"] == 1
    assert ThreadSide(restarted.service).list_sandboxes(ALICE) == []


def test_a_known_sandbox_removed_behind_the_agents_back_is_destroyed_false(
    world: World,
) -> None:
    """Say its timer expired it while the agent ran: the destroy finds it gone, as the second
    of two destroys does, and says so in its record."""
    target = world.create(ALICE)
    world.docker.remove(world.sandboxes.get(target).container_id)
    world.calls.clear()
    assert on_loop(world.service.destroy(ALICE, target, inline)).destroyed is False
    assert world.journal.events()[-1] == ("sandbox_destroyed", "ok")
    assert "gone already" in str(world.journal.entries[-1].get("SLICEBOX_DETAIL"))
    assert world.calls["docker.remove"] == 1


def test_a_destroy_while_another_removal_runs_answers_false_and_no_error(world: World) -> None:
    mine = world.create(ALICE)
    world.docker.begin_removal(world.sandboxes.get(mine).container_id)  # say, the reaper's
    assert ThreadSide(world.service).destroy(ALICE, mine).destroyed is False
    assert world.journal.events()[-1] == ("sandbox_destroyed", "ok")
    world.docker.finish_removal(world.sandboxes.get(mine).container_id)
    assert ThreadSide(world.service).destroy(ALICE, mine).destroyed is False
    assert ThreadSide(world.service).list_sandboxes(ALICE) == []


def test_one_shot_run_leaves_nothing(world: World) -> None:
    outcome = ThreadSide(world.service).run(
        ALICE, RunRequest(sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",)))
    )
    assert outcome.result.stdout == b"hi\n"
    assert ThreadSide(world.service).list_sandboxes(ALICE) == []
    assert [event for event, _ in world.journal.events()] == [
        "sandbox_created",
        "exec",
        "sandbox_destroyed",
    ]


def test_destroy_tree_only_touches_what_the_caller_may_see(world: World) -> None:
    alices = ThreadSide(world.service).create(ALICE, CreateSandbox(project="p", root_task_id="t1"))
    bobs = ThreadSide(world.service).create(BOB, CreateSandbox(project="p", root_task_id="t1"))
    gone = ThreadSide(world.service).destroy_tree(ALICE, "t1")
    assert [d.id for d in gone] == [alices.id]
    assert ThreadSide(world.service).get(BOB, bobs.id).id == bobs.id


def test_only_admins_run_the_reaper_and_a_dry_run_is_not_audited(world: World) -> None:
    with pytest.raises(Forbidden):
        ThreadSide(world.service).reap(ALICE, ReapRequest(dry_run=True))
    world.create(ALICE)
    before = len(world.journal.entries)
    assert ThreadSide(world.service).reap(ORCH, ReapRequest(dry_run=True)).plan == []
    assert len(world.journal.entries) == before


def test_extending_my_deadline_is_audited_and_others_cannot(world: World) -> None:
    mine = world.create(ALICE)
    with pytest.raises(NotFound):
        ThreadSide(world.service).extend(BOB, mine, Extend(ttl_seconds=60))
    view = ThreadSide(world.service).extend(ALICE, mine, Extend(ttl_seconds=7200))
    assert view.expires_at == NOW + timedelta(seconds=7200)
    assert ThreadSide(world.service).get(ALICE, mine).expires_at == NOW + timedelta(seconds=7200)
    assert world.journal.events()[-1] == ("deadline_changed", "ok")
    assert [unit for unit in world.systemd.timers if mine in unit] == [
        f"slicebox-ttl-{mine}-{int((NOW + timedelta(seconds=7200)).timestamp())}.timer"
    ]


# --- every exec is audited once, with how it ended -----------------------------------------


def execs(world: World) -> list[Mapping[str, str]]:
    """The audit records of execs: run, or refused as an exec."""
    return [
        e
        for e in world.journal.entries
        if e["SLICEBOX_EVENT"] == "exec" or e.get("SLICEBOX_DETAIL", "").startswith("exec ")
    ]


def endless(world: World) -> None:
    """The next exec prints a chunk per read until it is killed."""
    world.run.script = [[StreamChunk(stream=OutputStream.STDOUT, data=b"y" * 1000)]] * 50
    world.host.procs[world.run.pid] = 100


def test_an_abandoned_stream_is_audited_once_as_abandoned(world: World) -> None:
    box = world.create(ALICE)
    endless(world)
    events = ThreadSide(world.service).exec_stream(ALICE, box, ExecRequest(argv=("yes",)))
    assert [next(events), next(events)] == [
        StreamChunk(stream=OutputStream.STDOUT, data=b"y" * 1000)
    ] * 2
    events.close()
    assert world.host.kill_calls, "closing the stream kills the exec"
    [record] = execs(world)
    assert (record["SLICEBOX_EVENT"], record["SLICEBOX_RESULT"]) == ("exec", "abandoned")
    assert record["SLICEBOX_SANDBOX_ID"] == box
    assert "streamed stdout=2000 stderr=0 bytes" in record["SLICEBOX_DETAIL"]
    assert "SLICEBOX_EXIT_CODE" not in record, "nobody waited for an exit code"


def test_a_stream_abandoned_after_its_result_keeps_the_exit_code(world: World) -> None:
    box = world.create(ALICE)
    world.run.exit_code = 3
    events = ThreadSide(world.service).exec_stream(ALICE, box, ExecRequest(argv=("x",)))
    assert next(events) == StreamChunk(stream=OutputStream.STDOUT, data=b"hi\n")
    assert isinstance(next(events), ExecResult)
    events.close()
    [record] = execs(world)
    assert (record["SLICEBOX_RESULT"], record["SLICEBOX_EXIT_CODE"]) == ("abandoned", "3")
    assert "kept stdout=3 stderr=0 bytes" in record["SLICEBOX_DETAIL"]


def test_a_stream_read_to_its_end_is_audited_once(world: World) -> None:
    box = world.create(ALICE)
    events = list(ThreadSide(world.service).exec_stream(ALICE, box, ExecRequest(argv=("x",))))
    assert isinstance(events[-1], ExecResult)
    assert [(e["SLICEBOX_RESULT"], e["SLICEBOX_EXIT_CODE"]) for e in execs(world)] == [("ok", "0")]


def test_an_exec_on_an_unknown_or_foreign_sandbox_is_one_refused_record(world: World) -> None:
    mine = world.create(ALICE)
    with pytest.raises(NotFound):
        ThreadSide(world.service).exec(ALICE, "sbx-nothing", ExecRequest(argv=("id",)))
    with pytest.raises(NotFound):
        next(ThreadSide(world.service).exec_stream(BOB, mine, ExecRequest(argv=("id",))))
    unknown, foreign = execs(world)
    for record, target in ((unknown, "sbx-nothing"), (foreign, mine)):
        assert (record["SLICEBOX_EVENT"], record["SLICEBOX_RESULT"]) == (
            "request_refused",
            "not_found",
        )
        assert record["SLICEBOX_SANDBOX_ID"] == target
        assert record["SLICEBOX_DETAIL"].startswith("exec refused: no sandbox")
    assert "SLICEBOX_USER" not in foreign, "a refusal says no more about the owner than a 404"
    assert foreign["SLICEBOX_CALLER_UID"] == "1001"


def test_a_timed_out_exec_says_so(world: World) -> None:
    box = world.create(ALICE)
    world.run.script = []
    world.host.procs[world.run.pid] = 100
    result = ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("sleep", "9"), timeout=1))
    assert result.timed_out
    [record] = execs(world)
    assert (record["SLICEBOX_RESULT"], record["SLICEBOX_EXIT_CODE"]) == ("timed_out", "124")


def test_an_exec_that_fails_while_running_is_audited_with_its_code(world: World) -> None:
    box = world.create(ALICE)
    world.docker.stop(ThreadSide(world.service).get(ALICE, box).container_id)
    with pytest.raises(SandboxNotRunning):
        ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("id",)))
    [record] = execs(world)
    assert (record["SLICEBOX_EVENT"], record["SLICEBOX_RESULT"]) == ("exec", "sandbox_not_running")
    assert record["SLICEBOX_USER"] == "alice"


# --- the same on the event loop --------------------------------------------------------------


def on_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


async def streamed(
    world: World, who: Identity, box: str, request: ExecRequest, take: int | None = None
) -> list[ExecEvent]:
    """``aexec_stream`` read to its end, or closed after ``take`` events."""
    events = world.service.exec_stream(who, box, request, None, inline)
    got: list[ExecEvent] = []
    async with contextlib.aclosing(events):
        async for event in events:
            got.append(event)
            if len(got) == take:
                break
    return got


def free(world: World, box: str) -> bool:
    """No operation holds the sandbox: the reaper may claim it."""
    with world.sandboxes.claim(box) as claimed:
        return claimed


def test_an_exec_on_the_loop_is_audited_exactly_as_in_a_thread(world: World) -> None:
    box = world.create(ALICE)
    ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("x",)))
    world.run.script = [[StreamChunk(stream=OutputStream.STDOUT, data=b"hi\n")], None]
    result = on_loop(world.service.exec(ALICE, box, ExecRequest(argv=("x",)), None, inline))
    assert result.stdout == b"hi\n"
    in_thread, in_loop = execs(world)
    assert in_loop == in_thread
    assert (in_loop["SLICEBOX_RESULT"], in_loop["SLICEBOX_EXIT_CODE"]) == ("ok", "0")
    assert world.budget.in_use == 0
    assert free(world, box)


def test_a_stream_on_the_loop_closed_early_is_killed_and_audited_abandoned(world: World) -> None:
    box = world.create(ALICE)
    endless(world)
    got = on_loop(streamed(world, ALICE, box, ExecRequest(argv=("yes",)), take=2))
    assert len(got) == 2
    assert world.host.kill_calls == [world.run.pid], "closing the stream kills the exec"
    [record] = execs(world)
    assert (record["SLICEBOX_EVENT"], record["SLICEBOX_RESULT"]) == ("exec", "abandoned")
    assert "streamed stdout=2000 stderr=0 bytes" in record["SLICEBOX_DETAIL"]
    assert world.budget.in_use == 0
    assert free(world, box), "the operation mark is gone"


def test_a_stream_on_the_loop_read_to_its_end_is_audited_once(world: World) -> None:
    box = world.create(ALICE)
    events = on_loop(streamed(world, ALICE, box, ExecRequest(argv=("x",))))
    assert isinstance(events[-1], ExecResult)
    assert [(e["SLICEBOX_RESULT"], e["SLICEBOX_EXIT_CODE"]) for e in execs(world)] == [("ok", "0")]


def test_an_exec_on_the_loop_refused_or_timed_out_says_so(world: World) -> None:
    mine = world.create(ALICE)
    with pytest.raises(NotFound):
        on_loop(streamed(world, BOB, mine, ExecRequest(argv=("id",))))
    world.run.script = []
    world.host.procs[world.run.pid] = 100
    slow = ExecRequest(argv=("sleep", "9"), timeout=1)
    assert on_loop(world.service.exec(ALICE, mine, slow, None, inline)).timed_out
    refused, timed_out = execs(world)
    assert (refused["SLICEBOX_EVENT"], refused["SLICEBOX_RESULT"]) == (
        "request_refused",
        "not_found",
    )
    assert (timed_out["SLICEBOX_RESULT"], timed_out["SLICEBOX_EXIT_CODE"]) == ("timed_out", "124")
    assert world.budget.in_use == 0
    assert free(world, mine)


def created_record(step: Callable[[], object]) -> bool:
    """Whether ``step`` writes a create's audit record: the create is over."""
    args = step.args if isinstance(step, functools.partial) else ()
    return any(isinstance(a, AuditRecord) and a.event == "sandbox_created" for a in args)


def test_a_run_on_the_loop_destroys_its_sandbox_even_when_the_exec_fails(world: World) -> None:
    run = RunRequest(sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",)))
    assert on_loop(world.service.run(ALICE, run, None, inline)).result.stdout == b"hi\n"

    async def stopping(function: Callable[[], T]) -> T:
        """Runs each step in place; the sandbox's container stops right after its create."""
        value = function()
        if created_record(function):
            (container_id,) = world.docker.containers
            world.docker.stop(container_id)
        return value

    with pytest.raises(SandboxNotRunning):
        on_loop(world.service.run(ALICE, run, None, stopping))
    assert world.journal.events() == [
        ("sandbox_created", "ok"),
        ("exec", "ok"),
        ("sandbox_destroyed", "ok"),
        ("sandbox_created", "ok"),
        ("exec", "sandbox_not_running"),
        ("sandbox_destroyed", "ok"),
    ]
    assert ThreadSide(world.service).list_sandboxes(ALICE) == []
    assert world.budget.in_use == 0


def test_a_run_holds_its_sandbox_from_the_create_until_it_is_removed(world: World) -> None:
    """The reaper takes a one-shot sandbox nothing holds (``run_ended``): a run's own is held
    all along, and let go once removed."""
    run = RunRequest(sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",)))
    seen: list[object] = []

    async def reaping(function: Callable[[], T]) -> T:
        """Runs each step in place; a reaper pass right after the create."""
        value = function()
        if created_record(function):
            (made,) = world.sandboxes.find()
            seen.append(made.lineage.oneshot)
            seen.append(ThreadSide(world.service).reap(ORCH, ReapRequest()).plan)
        return value

    on_loop(world.service.run(ALICE, run, None, reaping))
    assert seen == [True, []]
    assert world.sandboxes.busy() == frozenset()
    world.run.script = [[], None]
    ThreadSide(world.service).run(ALICE, run)
    assert world.sandboxes.busy() == frozenset()
    assert world.docker.containers == {}


# --- a run answers before its removal ---------------------------------------------------------

RUN = RunRequest(sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",)))


class Later:
    """An :class:`~slicebox.core.blocking.Aside` that keeps what it takes until ``finish``."""

    def __init__(self, *, takes: bool = True) -> None:
        self.takes = takes
        self.taken: list[Callable[[Blocking], Awaitable[object]]] = []

    def __call__(self, make: Callable[[Blocking], Awaitable[object]]) -> bool:
        if self.takes:
            self.taken.append(make)
        return self.takes

    def finish(self) -> None:
        while self.taken:
            from_thread(self.taken.pop(0))


def usage_reads(world: World) -> list[str]:
    """Every final usage read from here on, by sandbox id."""
    reads: list[str] = []
    views = world.service._views
    read = views.final_usage

    def counted(sandbox: Sandbox) -> Any:
        reads.append(sandbox.id)
        return read(sandbox)

    views.final_usage = counted  # type: ignore[method-assign]
    return reads


def test_a_run_answers_before_its_removal_which_follows_held_and_audited(world: World) -> None:
    later, reads = Later(), usage_reads(world)
    outcome = on_loop(world.service.run(ALICE, RUN, None, inline, later))
    assert (outcome.result.stdout, outcome.usage is not None) == (b"hi\n", True)
    assert len(later.taken) == 1, "the removal is left for after the answer"
    assert [s.id for s in world.sandboxes.find()] == [outcome.sandbox_id]
    assert world.sandboxes.busy() == {outcome.sandbox_id}, "held: the reaper leaves it be"
    assert ThreadSide(world.service).reap(ORCH, ReapRequest()).plan == []
    assert world.journal.events() == [("sandbox_created", "ok"), ("exec", "ok")]
    assert world.budget.in_use == 0, "the answer's reservation does not wait for the removal"
    later.finish()
    assert world.docker.containers == {}
    assert world.systemd.timers == {}, "its deadline is disarmed"
    assert world.sandboxes.busy() == frozenset()
    assert world.journal.events()[2:] == [("sandbox_destroyed", "ok")]
    destroyed = world.journal.entries[2]
    assert destroyed["SLICEBOX_USAGE_SANDBOX_PROVISIONED_CPU"] == "0.5"
    assert reads == [outcome.sandbox_id], "the answered usage is the one audited: read once"


def test_a_removal_not_taken_aside_runs_before_the_answer(world: World) -> None:
    outcome = on_loop(world.service.run(ALICE, RUN, None, inline, Later(takes=False)))
    assert outcome.result.stdout == b"hi\n"
    assert world.docker.containers == {}
    assert [event for event, _ in world.journal.events()] == [
        "sandbox_created",
        "exec",
        "sandbox_destroyed",
    ]
    assert world.sandboxes.busy() == frozenset()


def test_a_failed_removal_after_the_answer_is_audited_and_left_to_the_reaper(
    world: World,
) -> None:
    later = Later()
    outcome = on_loop(world.service.run(ALICE, RUN, None, inline, later))
    world.docker.down = "restarting"
    later.finish()  # raises nothing: the run has answered
    assert world.journal.events()[2:] == [("sandbox_destroyed", "unavailable")]
    assert world.sandboxes.busy() == frozenset(), "let go: the reaper may take it"
    world.docker.down = None
    report = ThreadSide(world.service).reap(ORCH, ReapRequest())
    assert [(a.rule, a.target) for a in report.plan][:1] == [("run_ended", outcome.sandbox_id)]
    assert world.docker.containers == {}


def test_a_run_whose_caller_goes_away_mid_exec_still_removes_its_sandbox(world: World) -> None:
    later = Later()
    endless(world)

    async def cancelled() -> None:
        task = asyncio.ensure_future(world.service.run(ALICE, RUN, None, inline, later))
        while not world.exec_api.launched:  # the command has gone to the sandbox's waiter
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    on_loop(cancelled())
    assert world.host.kill_calls, "the run's processes are killed"
    assert world.run.pid not in world.host.procs
    assert len(later.taken) == 1
    later.finish()
    assert world.docker.containers == {}
    assert world.journal.events() == [
        ("sandbox_created", "ok"),
        ("exec", "abandoned"),
        ("sandbox_destroyed", "ok"),
    ]
    assert world.budget.in_use == 0
    assert world.sandboxes.busy() == frozenset()


def test_a_streamed_run_yields_its_output_then_its_result_and_a_closed_one_still_removes(
    world: World,
) -> None:
    """Chunks as the command prints them, then the RunResult; a reader that leaves after the
    first chunk has the command killed (audited abandoned) and its sandbox removed."""

    async def read_all() -> list[StreamChunk | RunResult]:
        return [e async for e in world.service.run_stream(ALICE, RUN, None, inline)]

    first, last = on_loop(read_all())
    assert first == StreamChunk(stream=OutputStream.STDOUT, data=b"hi\n")
    assert isinstance(last, RunResult)
    assert (last.result.stdout, last.result.exit_code) == (b"hi\n", 0)
    assert world.docker.containers == {}
    endless(world)

    async def leave_early() -> StreamChunk | RunResult:
        events = world.service.run_stream(ALICE, RUN, None, inline)
        try:
            return await anext(events)
        finally:
            await events.aclose()

    assert isinstance(on_loop(leave_early()), StreamChunk)
    assert world.host.kill_calls, "the command is killed"
    assert world.docker.containers == {}
    assert world.journal.events()[-3:] == [
        ("sandbox_created", "ok"),
        ("exec", "abandoned"),
        ("sandbox_destroyed", "ok"),
    ]
    assert world.budget.in_use == 0
    assert world.sandboxes.busy() == frozenset()


def test_a_run_never_looks_up_the_sandbox_it_created_and_answers_before_removing_it(
    world: World,
) -> None:
    """The Docker and systemd calls of a run into a project whose slices exist, before its
    answer and after: the exec and the removal act on the sandbox the create returned (no
    inspect by name), the image is not checked again, the new timer is only started, and the
    removal waits for no answer."""
    on_loop(world.service.run(ALICE, RUN, None, inline))  # the project's slices exist now
    world.run.script = [[StreamChunk(stream=OutputStream.STDOUT, data=b"hi\n")], None]
    on_loop(world.service.run(ALICE, RUN, None, inline))  # ... with their ceilings set
    world.run.script = [[StreamChunk(stream=OutputStream.STDOUT, data=b"hi\n")], None]
    world.calls.clear()
    later = Later()
    assert on_loop(world.service.run(ALICE, RUN, None, inline, later)).result.stdout == b"hi\n"
    answered = dict(world.calls)
    world.calls.clear()
    later.finish()
    assert answered == {
        "docker.create": 1,  # Docker's create and start; the image is known present
        # The command goes to the sandbox's waiter, in the scope its labels give: no exec to
        # create, start and inspect, and no look-up of its init.
        "docker.launch_async": 1,
        "systemd.invocation": 3,  # the three slices run as they did when given ceilings
        "systemd.start_timer": 1,  # the deadline of a new sandbox: nothing to look for
    }
    assert dict(world.calls) == {
        "docker.remove": 1,
        "systemd.is_active": 1,  # the scope has stopped, and its timer with it
    }
    web = "slicebox.slice/slicebox-alice.slice/slicebox-alice-web.slice"
    assert world.host.scopes == [f"{web}/docker-{n:064x}.scope" for n in (1, 2, 3)]


def test_a_run_hands_its_command_to_the_waiter_its_sandbox_was_made_with(world: World) -> None:
    """A one-shot run's sandbox runs the waiter with its stdin open, labelled so; the run's
    command, env, working directory and stdin go to it in one write, and the answer is the
    command's (the waiter's markers cut off)."""
    world.run.exit_code = 3
    run = RunRequest(
        sandbox=CreateSandbox(project="web"),
        exec=ExecRequest(argv=("printf", "it's"), env={"A_B": "x y"}, cwd="/w", stdin=b"in"),
    )
    ran = on_loop(world.service.run(ALICE, run, None, inline))
    assert (ran.result.stdout, ran.result.stderr, ran.result.exit_code) == (b"hi\n", b"", 3)
    [container] = world.docker.removed
    request = world.docker.requests[container]
    assert (request.command, request.open_stdin) == (WAITER_COMMAND, True)
    assert request.labels["slicebox.launcher"] == "sh"
    assert world.exec_api.launched == [container]
    sent = world.run.stdin
    assert sent.startswith(b"(cd /w || exit 126; export 'A_B=x y'; exec printf 'it'\"'\"'s');")
    assert sent.endswith(b"exec sleep infinity\nin")
    assert world.journal.events() == [
        ("sandbox_created", "ok"),
        ("exec", "ok"),
        ("sandbox_destroyed", "ok"),
    ]


def test_a_run_whose_env_the_line_cannot_carry_is_a_docker_exec(world: World) -> None:
    run = RunRequest(
        sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",), env={"a-b": "1"})
    )
    ran = on_loop(world.service.run(ALICE, run, None, inline))
    assert ran.result.stdout == b"hi\n"
    assert world.exec_api.launched == []
    assert world.run.request is not None
    assert world.run.request.env == {"a-b": "1"}


def test_a_launched_run_past_its_timeout_is_killed_whole_and_answers_124(world: World) -> None:
    endless(world)
    world.host.started[world.run.pid] = 10**6  # started after the run began
    world.host.procs[1] = 0  # the sandbox's init and its waiter, older than the run
    world.host.started[1] = 0
    run = RunRequest(sandbox=CreateSandbox(project="web"), exec=ExecRequest(argv=("x",), timeout=2))
    ran = on_loop(world.service.run(ALICE, run, None, inline))
    assert (ran.result.exit_code, ran.result.timed_out) == (124, True)
    assert world.run.pid not in world.host.procs, "the run's processes are killed"
    assert 1 in world.host.procs, "the sandbox's own are older: it lives on until removed"


def test_a_created_sandbox_sleeps_and_a_reuse_pool_member_too(world: World) -> None:
    """Only a one-shot run's sandbox (and a member of a pool that does not reuse) waits for a
    line: a created sandbox and a command of the caller's are what they were."""
    world.create(ALICE)
    commanded = CreateSandbox(project="web", command=("sleep", "9"))
    ThreadSide(world.service).create(ALICE, commanded)
    requests = list(world.docker.requests.values())
    assert [(r.command, r.open_stdin) for r in requests] == [
        (KEEP_ALIVE, False),
        (("sleep", "9"), False),
    ]
    assert [r.labels["slicebox.launcher"] for r in requests] == ["", ""]


def test_an_exec_in_a_running_sandbox_costs_one_look_up(world: World) -> None:
    """Its look-up says it runs: the exec goes to the scope its labels give, with no second
    inspect for the container's init."""
    box = world.create(ALICE)
    world.calls.clear()
    on_loop(world.service.exec(ALICE, box, ExecRequest(argv=("x",)), None, inline))
    assert (world.calls["docker.inspect"], world.calls["docker.sandbox_pid"]) == (1, 0)
    web = "slicebox.slice/slicebox-alice.slice/slicebox-alice-web.slice"
    assert world.host.scopes == [f"{web}/docker-{1:064x}.scope"]


def test_an_exec_in_a_stopped_sandbox_asks_for_its_init_and_is_refused(world: World) -> None:
    box = world.create(ALICE)
    world.docker.stop(ThreadSide(world.service).get(ALICE, box).container_id)
    world.calls.clear()
    with pytest.raises(SandboxNotRunning):
        on_loop(world.service.exec(ALICE, box, ExecRequest(argv=("x",)), None, inline))
    assert world.calls["docker.sandbox_pid"] == 1
    assert world.calls["docker.exec_create"] == 0
