"""The reaper's planner, rule by rule, with an injected clock; and its executor over fakes."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from slicebox.backends.base import SandboxInfo, SandboxRequest, SandboxState, VolumeInfo
from slicebox.core.deadlines import Deadlines, Timer, expire_command, find_program, timer_unit
from slicebox.core.reaper import Reaper
from slicebox.core.reaping import TIMER_GRACE, Observed, plan, plan_pass
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.journal import Auditor
from slicebox.host.systemd import UnitStatus
from slicebox.model.audit import AuditEvent
from slicebox.model.config import OrphanPolicy, ReaperConfig, parse_config
from slicebox.model.errors import HostError, SandboxNotRunning
from slicebox.model.labels import MANAGED, Lineage, decode
from slicebox.model.names import DOCKER_SCOPES, PODMAN_SCOPES, SCOPE_PREFIX_ENV, use_scope_prefix
from slicebox.model.reaper import Action, Kind, Rule
from slicebox.model.spec import SandboxSpec
from tests.fakes.docker import FakeDocker, volume_labels
from tests.fakes.journal import ListJournal
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import created

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
NOW_S = "2026-01-02T03:04:05+00:00"
RUN = "run-now"
POLICY = ReaperConfig(empty_slice_grace_seconds=0)  # the grace has tests of its own


def box(
    sandbox_id: str,
    *,
    status: str = "running",
    parent: str = "",
    depth: int = 0,
    ttl: float | None = 3600,
    run: str = RUN,
    user: str = "alice",
    project: str = "p",
    pool: bool = False,
    oneshot: bool = False,
    age: float = 60,
) -> SandboxInfo:
    created = NOW - timedelta(seconds=age)
    lineage = Lineage(
        sandbox_id=sandbox_id,
        instance_id=run,
        root_task_id="t1",
        task_id=sandbox_id,
        parent_id=parent,
        depth=depth,
        user=user,
        project=project,
        created_at=created,
        expires_at=None if ttl is None else created + timedelta(seconds=ttl),
        provisioned_cpu=0.5,
        provisioned_memory_bytes=256 << 20,
        provisioned_pids=100,
        pool=pool,
        oneshot=oneshot,
    )
    return SandboxInfo(
        id=f"c-{sandbox_id}",
        name=sandbox_id,
        labels=lineage.to_labels(),
        state=SandboxState(status),
    )


def observed(*containers: SandboxInfo, **fields: object) -> Observed:
    return Observed.model_validate({"instance_id": RUN, "containers": containers, **fields})


def kinds(actions: list[Action]) -> list[tuple[Kind, Rule, str]]:
    return [(a.kind, a.rule, a.target) for a in actions]


def test_a_live_sandbox_of_this_run_with_its_timer_needs_nothing() -> None:
    timer = Timer(unit="t", sandbox_id="a", at=NOW + timedelta(hours=1))
    found = observed(box("a"), slices=["slicebox-alice.slice", "slicebox-alice-p.slice"])
    assert plan(found.model_copy(update={"timers": [timer]}), NOW, POLICY) == []


def test_expired_sandboxes_are_destroyed_and_the_clock_decides() -> None:
    found = observed(box("a", ttl=30, age=60), box("b", ttl=120, age=60))
    assert kinds(plan(found, NOW, POLICY))[:1] == [(Kind.DESTROY, Rule.EXPIRED, "a")]
    later = plan(found, NOW + timedelta(seconds=61), POLICY)
    assert {a.target for a in later if a.rule is Rule.EXPIRED} == {"a", "b"}


def test_an_extended_timer_outlives_the_label_and_a_shortened_one_wins() -> None:
    extended = Timer(unit="x", sandbox_id="a", at=NOW + timedelta(hours=2))
    found = observed(box("a", ttl=30, age=60), timers=[extended])
    assert [a for a in plan(found, NOW, POLICY) if a.kind is Kind.DESTROY] == []
    shortened = Timer(unit="y", sandbox_id="b", at=NOW - TIMER_GRACE - timedelta(seconds=1))
    found = observed(box("b", ttl=3600), timers=[shortened])
    assert kinds(plan(found, NOW, POLICY)) == [(Kind.DESTROY, Rule.EXPIRED, "b")]


def test_a_deadline_a_timer_holds_is_its_expiry_s_first_then_the_reaper_s() -> None:
    """The timer runs ``sliceboxd expire`` at the deadline, which audits and removes; a pass
    in the meantime must not audit the same expiry again."""
    timer = Timer(unit="t", sandbox_id="a", at=NOW - timedelta(seconds=1))
    held = observed(box("a", ttl=30, age=31), timers=[timer])
    assert [a for a in plan(held, NOW, POLICY) if a.kind is Kind.DESTROY] == []
    late = NOW + TIMER_GRACE
    assert kinds(plan(held, late, POLICY)) == [(Kind.DESTROY, Rule.EXPIRED, "a")], "it failed"
    unheld = observed(box("a", ttl=30, age=31))  # the timer is gone (its expiry ran) or was lost
    assert kinds(plan(unheld, NOW, POLICY)) == [(Kind.DESTROY, Rule.EXPIRED, "a")]


def test_a_three_level_tree_goes_deepest_first_when_its_root_expires() -> None:
    found = observed(
        box("root", ttl=10),
        box("child", parent="root", depth=1),
        box("grandchild", parent="child", depth=2),
        box("other"),
    )
    destroys = [a for a in plan(found, NOW, POLICY) if a.kind is Kind.DESTROY]
    assert [(a.target, a.rule) for a in destroys] == [
        ("grandchild", Rule.PARENT_GONE),
        ("child", Rule.PARENT_GONE),
        ("root", Rule.EXPIRED),
    ]
    assert [a.depth for a in destroys] == [2, 1, 0]


def test_children_of_a_parent_that_is_gone_are_destroyed() -> None:
    found = observed(box("child", parent="vanished", depth=1))
    assert kinds(plan(found, NOW, POLICY)) == [(Kind.DESTROY, Rule.PARENT_GONE, "child")]


def test_a_child_whose_parent_is_still_being_created_is_left_alone() -> None:
    found = observed(box("child", parent="p1", depth=1, ttl=None), in_flight={"p1": ("alice", "p")})
    assert plan(found, NOW, POLICY) == []


def test_orphans_of_another_run_are_adopted_by_default_and_reaped_on_request() -> None:
    found = observed(box("a", run="run-old", ttl=None))
    assert kinds(plan(found, NOW, POLICY)) == [(Kind.ADOPT, Rule.ADOPT, "a")]
    adopted = found.model_copy(update={"adopted": frozenset({"a"})})
    assert plan(adopted, NOW, POLICY) == []
    reap = POLICY.model_copy(update={"orphans": OrphanPolicy.REAP})
    assert kinds(plan(found, NOW, reap)) == [(Kind.DESTROY, Rule.ORPHAN, "a")]
    assert plan(adopted, NOW, reap) == [], "what this run adopted is its own"


def test_an_adopted_orphan_still_expires() -> None:
    found = observed(box("a", run="run-old", ttl=10), adopted=frozenset({"a"}))
    assert kinds(plan(found, NOW, POLICY)) == [(Kind.DESTROY, Rule.EXPIRED, "a")]


def test_managed_containers_without_readable_lineage_are_removed() -> None:
    bare = SandboxInfo(id="c-bare", name="x", labels={MANAGED: "true"}, state=SandboxState.RUNNING)
    broken = box("b").model_copy(update={"labels": {**box("b").labels, "slicebox.depth": "deep"}})
    actions = plan(observed(bare, broken), NOW, POLICY)
    assert (actions[1].user, actions[1].sandbox_id) == ("alice", "b"), "kept for the audit"
    assert kinds(actions) == [
        (Kind.REMOVE_CONTAINER, Rule.MISSING_LINEAGE, "c-bare"),
        (Kind.REMOVE_CONTAINER, Rule.MISSING_LINEAGE, "c-b"),
    ]


def test_exited_and_never_started_containers_are_stale_unless_a_create_runs() -> None:
    found = observed(box("a", status="exited"), box("b", status="dead"), box("c", status="created"))
    assert kinds(plan(found, NOW, POLICY)) == [
        (Kind.DESTROY, Rule.EXITED, "a"),
        (Kind.DESTROY, Rule.EXITED, "b"),
        (Kind.DESTROY, Rule.NEVER_STARTED, "c"),
    ]
    creating = observed(box("c", status="created"), in_flight={"c": ("alice", "p")})
    assert plan(creating, NOW, POLICY) == []


def test_paused_or_restarting_containers_are_not_touched() -> None:
    timer = Timer(unit="t", sandbox_id="a", at=NOW + timedelta(hours=1))
    found = observed(box("a", status="paused"), timers=[timer])
    assert plan(found, NOW, POLICY) == []


def test_a_one_shot_sandbox_no_operation_holds_is_removed_whoever_made_it() -> None:
    """A run holds its sandbox until its removal is over: one that nothing holds was left
    over (its agent stopped, or the removal failed), of this agent run or another."""
    found = observed(
        box("left", oneshot=True),
        box("theirs", oneshot=True, run="run-before"),
        box("running", oneshot=True),
        box("done", oneshot=True, status="exited"),
        box("kept"),
        busy=frozenset({"running", "kept"}),
    )
    destroys = [(r, t) for k, r, t in kinds(plan(found, NOW, POLICY)) if k is Kind.DESTROY]
    assert sorted(destroys) == [
        (Rule.EXITED, "done"),
        (Rule.RUN_ENDED, "left"),
        (Rule.RUN_ENDED, "theirs"),
    ]


def test_idle_pool_members_beyond_the_size_go_oldest_first_per_kind() -> None:
    found = observed(
        box("p1", pool=True, age=300),
        box("p2", pool=True, age=200),
        box("p3", pool=True, age=100),
        box("q1", pool=True, project="q"),
        box("busy"),
    )
    policy = POLICY.model_copy(update={"pool_size": 1})
    surplus = [a.target for a in plan(found, NOW, policy) if a.rule is Rule.POOL_SURPLUS]
    assert surplus == ["p1", "p2"]
    assert len([a for a in plan(found, NOW, POLICY) if a.kind is Kind.DESTROY]) == 4


def test_a_running_sandbox_without_its_timer_gets_it_back_from_the_label() -> None:
    actions = plan(observed(box("a", ttl=600, age=60)), NOW, POLICY)
    assert kinds(actions) == [(Kind.ARM_DEADLINE, Rule.DEADLINE_MISSING, "a")]
    assert actions[0].deadline == NOW + timedelta(seconds=540)
    assert plan(observed(box("b", ttl=None)), NOW, POLICY) == [], "no TTL, no timer"


def test_timers_and_state_dirs_of_gone_sandboxes_are_removed() -> None:
    timers = [
        Timer(unit="slicebox-ttl-gone-1.timer", sandbox_id="gone", at=NOW),
        Timer(unit="slicebox-ttl-a-2.timer", sandbox_id="a", at=NOW + timedelta(hours=1)),
        Timer(unit="slicebox-ttl-new-3.timer", sandbox_id="new", at=NOW + timedelta(hours=1)),
    ]
    found = observed(
        box("a"),
        timers=timers,
        state_dirs=["a", "gone", "new"],
        in_flight={"new": ("alice", "p")},
    )
    assert kinds(plan(found, NOW, POLICY)) == [
        (Kind.STOP_TIMER, Rule.STALE_DEADLINE, "slicebox-ttl-gone-1.timer"),
        (Kind.REMOVE_FILES, Rule.LEFTOVER_FILES, "gone"),
    ]


def volume(name: str, root_task_id: str, *, user: str = "alice", keep: bool = False) -> VolumeInfo:
    return VolumeInfo(name=name, labels=volume_labels(user, root_task_id, keep=keep), mountpoint="")


def test_volumes_of_a_gone_root_task_go_unless_kept_or_a_create_of_their_user_runs() -> None:
    timer = Timer(unit="t", sandbox_id="a", at=NOW + timedelta(hours=1))
    volumes = [
        volume("live", "t1"),  # box("a") is of root task t1
        volume("gone", "t9"),
        volume("kept", "t9", keep=True),
        volume("bobs", "t8", user="bob"),
        VolumeInfo(name="foreign", labels={"slicebox.volume": "true"}, mountpoint=""),
    ]
    found = observed(
        box("a"),
        timers=[timer],
        slices=["slicebox-alice.slice", "slicebox-alice-p.slice"],
        volumes=volumes,
    )
    actions = plan(found, NOW, POLICY)
    assert kinds(actions) == [
        (Kind.REMOVE_VOLUME, Rule.VOLUME_ORPHANED, "bobs"),
        (Kind.REMOVE_VOLUME, Rule.VOLUME_ORPHANED, "gone"),
    ]
    assert actions[1].root_task_id == "t9"
    creating = found.model_copy(update={"in_flight": {"new": ("bob", "q")}})
    assert kinds(plan(creating, NOW, POLICY)) == [
        (Kind.REMOVE_VOLUME, Rule.VOLUME_ORPHANED, "gone")
    ]


def test_empty_slices_go_projects_before_users_and_in_use_ones_stay() -> None:
    slices = [
        "slicebox-alice.slice",
        "slicebox-alice-p.slice",
        "slicebox-alice-q.slice",
        "slicebox-bob.slice",
        "slicebox-bob-x.slice",
        "slicebox-carol.slice",
        "slicebox-carol-y.slice",
        "slicebox-not\\x2dours-a-b-c.slice",
    ]
    timer = Timer(unit="t", sandbox_id="a", at=NOW + timedelta(hours=1))
    found = observed(
        box("a"), slices=slices, timers=[timer], in_flight={"creating": ("carol", "y")}
    )
    assert kinds(plan(found, NOW, POLICY)) == [
        (Kind.STOP_SLICE, Rule.EMPTY_SLICE, "slicebox-alice-q.slice"),
        (Kind.STOP_SLICE, Rule.EMPTY_SLICE, "slicebox-bob-x.slice"),
        (Kind.STOP_SLICE, Rule.EMPTY_SLICE, "slicebox-bob.slice"),
    ]


def test_a_slice_whose_last_sandbox_goes_in_this_pass_goes_after_it() -> None:
    found = observed(box("a", ttl=1), slices=["slicebox-alice.slice", "slicebox-alice-p.slice"])
    assert kinds(plan(found, NOW, POLICY)) == [
        (Kind.DESTROY, Rule.EXPIRED, "a"),
        (Kind.STOP_SLICE, Rule.EMPTY_SLICE, "slicebox-alice-p.slice"),
        (Kind.STOP_SLICE, Rule.EMPTY_SLICE, "slicebox-alice.slice"),
    ]


def test_an_empty_slice_is_stopped_only_once_its_grace_is_over() -> None:
    units = ["slicebox-alice.slice", "slicebox-alice-p.slice", "slicebox-alice-q.slice"]
    policy = ReaperConfig(empty_slice_grace_seconds=300)
    first = plan_pass(observed(box("a"), slices=units), NOW, policy)
    assert kinds(first.actions) == [(Kind.ARM_DEADLINE, Rule.DEADLINE_MISSING, "a")]
    assert first.empty_since == {"slicebox-alice-q.slice": NOW}, "empty from now, in use not"
    later = observed(box("a"), slices=units, empty_since=first.empty_since)
    assert plan_pass(later, NOW + timedelta(seconds=299), policy).actions[1:] == []
    due = plan_pass(later, NOW + timedelta(seconds=300), policy)
    assert [(a.kind, a.target, a.reason) for a in due.actions[1:]] == [
        (Kind.STOP_SLICE, "slicebox-alice-q.slice", f"no sandbox of alice/q is left since {NOW_S}")
    ]
    assert due.empty_since == first.empty_since, "the memory keeps the first sighting"


def test_a_slice_in_use_again_forgets_since_when_it_was_empty() -> None:
    units = ["slicebox-alice.slice", "slicebox-alice-p.slice"]
    policy = ReaperConfig(empty_slice_grace_seconds=300)
    long_ago = {unit: NOW - timedelta(hours=1) for unit in units}
    timer = Timer(unit="t", sandbox_id="a", at=NOW + timedelta(hours=1))
    used = plan_pass(
        observed(box("a"), slices=units, timers=[timer], empty_since=long_ago), NOW, policy
    )
    assert used == ([], {})


# --- the executor over fakes -------------------------------------------------------------


class World:
    def __init__(self, tmp: Path) -> None:
        self.now = NOW
        self.systemd = FakeSystemd()
        self.docker = FakeDocker(self.systemd)
        self.slices = SliceManager(self.systemd)
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.manager = SandboxManager(
            self.docker,
            self.slices,
            config=parse_config(""),
            host_memory=8 << 30,
            instance_id=RUN,
            clock=lambda: self.now,
            new_id=lambda: next(ids),
            deadlines=Deadlines(self.systemd, program=lambda: "/usr/bin/sliceboxd"),
        )
        self.journal = ListJournal()
        self.config = ReaperConfig(state_dir=tmp / "state", empty_slice_grace_seconds=0)
        self.reaper = Reaper(
            self.manager,
            self.slices,
            self.docker,
            auditor=Auditor(self.journal),
            config=lambda: self.config,
            clock=lambda: self.now,
        )

    def create(self, **fields: object) -> str:
        spec = SandboxSpec.model_validate({"user": "alice", "project": "p", **fields})
        return created(self.manager, spec).id


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_create_arms_a_timer_that_runs_the_expiry_and_destroy_disarms_it(world: World) -> None:
    sandbox_id = world.create(ttl_seconds=60)
    container = world.manager.get(sandbox_id).container_id
    unit = timer_unit(sandbox_id, NOW + timedelta(seconds=60))
    at, argv = world.systemd.timers[unit]
    assert at == NOW + timedelta(seconds=60)
    epoch = str(int(at.timestamp()))
    assert argv == ["/usr/bin/sliceboxd", "expire", sandbox_id, container, "--deadline", epoch]
    world.manager.destroy(sandbox_id)
    assert world.systemd.timers == {}


def test_a_create_arms_its_timer_in_one_call_and_fails_whole_if_the_name_is_taken(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new sandbox has no timer to look for or stop: only the start reaches systemd."""
    unit = timer_unit("sbx-000000000001", NOW + timedelta(seconds=60))
    world.systemd.start_timer(unit, NOW, ["/bin/true"], "taken, against all odds")
    with pytest.raises(HostError) as taken:
        world.create(ttl_seconds=60)
    assert taken.value.code == "unit_exists"
    assert world.docker.containers == {}, "the container is removed"
    assert not [u for u in world.systemd.running if u.startswith("slicebox-alice")]
    asked: list[str] = []
    list_units, status = world.systemd.list_units, world.systemd.status

    def listing(pattern: str, *, active_only: bool = False) -> list[str]:
        asked.append(pattern)
        return list_units(pattern, active_only=active_only)

    def looking(unit: str) -> UnitStatus:
        asked.append(unit)
        return status(unit)

    monkeypatch.setattr(world.systemd, "list_units", listing)
    monkeypatch.setattr(world.systemd, "status", looking)
    world.create(ttl_seconds=60)
    assert not [u for u in asked if ".timer" in u], asked


def test_a_destroy_makes_no_timer_call_its_timer_stops_with_the_scope(world: World) -> None:
    sandbox_id = world.create(ttl_seconds=60)
    [timer] = world.systemd.timers
    assert world.systemd.bound[timer].startswith("docker-")
    world.systemd.calls.clear()
    assert world.manager.destroy(sandbox_id) is not None
    assert (world.docker.containers, world.systemd.timers) == ({}, {})
    assert world.systemd.calls == [], "no listing, no stop: systemd stops it with the scope"


def test_an_exited_sandbox_s_timer_stops_with_its_scope(world: World) -> None:
    sandbox_id = world.create(ttl_seconds=60)
    [container] = world.docker.containers
    world.docker.stop(container)
    assert world.systemd.timers == {}
    assert world.manager.get(sandbox_id).expires_at is not None, "the label keeps the deadline"


def test_a_deadline_is_not_armed_for_a_container_that_runs_no_more(world: World) -> None:
    deadlines = Deadlines(world.systemd)
    with pytest.raises(SandboxNotRunning, match="sbx-a has stopped"):
        deadlines.arm("sbx-a", "c-gone", NOW + timedelta(seconds=60))
    assert world.systemd.timers == {}


def test_a_sandbox_whose_command_ended_at_once_is_made_without_a_timer_and_reaped_as_exited(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = world.docker.create

    def ends_at_once(request: SandboxRequest) -> SandboxInfo:
        made = created(request)
        world.docker.stop(made.id)  # `true`: done before its deadline could be armed
        return made

    monkeypatch.setattr(world.docker, "create", ends_at_once)
    sandbox_id = world.create(ttl_seconds=60, command=["true"])
    assert world.systemd.timers == {}
    with pytest.raises(SandboxNotRunning, match="has stopped") as refused:
        world.manager.extend(sandbox_id, 600)
    assert refused.value.http_status == 409
    done = world.reaper.run()
    assert [(a.rule, a.target) for a in done.plan][:1] == [(Rule.EXITED, sandbox_id)]
    assert world.docker.containers == {}


def test_without_sliceboxd_the_timer_only_kills_the_scope(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    deadlines = Deadlines(world.systemd, systemctl="/usr/bin/systemctl")
    at = NOW + timedelta(seconds=60)
    world.systemd.running.update({"docker-c1.scope", "docker-c2.scope"})
    deadlines.arm("sbx-a", "c1", at)
    deadlines.arm("sbx-b", "c2", at)
    assert world.systemd.timers[timer_unit("sbx-a", at)][1] == [
        "/usr/bin/systemctl",
        "kill",
        "--signal=SIGKILL",
        "docker-c1.scope",
    ]
    assert [r.levelname for r in caplog.records] == ["WARNING"], "said once, not per arm"


def test_sliceboxd_is_the_agent_s_own_program_else_the_one_on_path() -> None:
    def which(name: str) -> str | None:
        return "/usr/bin/sliceboxd" if name == "sliceboxd" else None

    def runnable(path: str) -> bool:
        return path in {"/usr/local/bin/sliceboxd", "/usr/bin/sliceboxd"}

    assert find_program("/usr/local/bin/sliceboxd", which, runnable) == "/usr/local/bin/sliceboxd"
    assert find_program("/opt/gone/sliceboxd", which, runnable) == "/usr/bin/sliceboxd"
    assert find_program("/usr/bin/pytest", which, runnable) == "/usr/bin/sliceboxd"
    assert find_program("/usr/bin/pytest", lambda name: None, runnable) is None


def test_extend_arms_the_later_timer_then_stops_the_earlier(world: World) -> None:
    sandbox_id = world.create(ttl_seconds=60)
    extended = world.manager.extend(sandbox_id, 7200)
    assert extended.expires_at == NOW + timedelta(seconds=7200)
    assert list(world.systemd.timers) == [timer_unit(sandbox_id, NOW + timedelta(seconds=7200))]
    assert world.manager.get(sandbox_id).expires_at == NOW + timedelta(seconds=60), "labels"
    current = world.manager.get(sandbox_id, current_deadline=True)
    assert current.expires_at == NOW + timedelta(seconds=7200)
    world.now = NOW + timedelta(seconds=120)
    assert world.reaper.run().plan == [], "the extended deadline holds, not the label's"


def test_a_pass_destroys_the_expired_audits_each_action_and_dry_run_changes_nothing(
    world: World,
) -> None:
    keep, doomed = world.create(ttl_seconds=3600), world.create(ttl_seconds=10, project="q")
    (world.config.state_dir / "sbx-gone").mkdir(parents=True)
    world.now = NOW + timedelta(seconds=11) + TIMER_GRACE  # the fake timers never fire
    dry = world.reaper.run(dry_run=True)
    assert dry.dry_run
    assert dry.outcomes == []
    assert [(a.kind, a.target) for a in dry.plan] == [
        (Kind.DESTROY, doomed),
        (Kind.REMOVE_FILES, "sbx-gone"),
        (Kind.STOP_SLICE, "slicebox-alice-q.slice"),
    ]
    assert {s.id for s in world.manager.find()} == {keep, doomed}
    assert world.journal.entries == []
    done = world.reaper.run()
    assert [o.result for o in done.outcomes] == ["ok", "ok", "ok"]  # destroys leave slices
    assert [s.id for s in world.manager.find()] == [keep]
    assert not (world.config.state_dir / "sbx-gone").exists()
    rules = [e["SLICEBOX_REAPER_RULE"] for e in world.journal.entries]
    assert rules == ["expired", "leftover_files", "empty_slice"]
    assert {e["SLICEBOX_EVENT"] for e in world.journal.entries} == {AuditEvent.REAPER_ACTION}
    assert world.reaper.run().plan == [], "a second pass finds nothing"


def test_a_one_shot_sandbox_is_held_from_its_create_and_taken_once_let_go(world: World) -> None:
    spec = SandboxSpec.model_validate({"user": "alice", "project": "p"})
    held = created(world.manager, spec, one_shot=True)
    assert held.lineage.oneshot
    assert world.manager.busy() == {held.id}, "held as it left in flight"
    assert world.reaper.run().plan == [], "a run holds it: not even planned"
    world.manager.end_operation(held.id)  # say, the run's removal failed
    report = world.reaper.run()
    done = zip(report.plan, report.outcomes, strict=True)
    assert [(a.kind, a.rule, o.result) for a, o in done][:1] == [
        (Kind.DESTROY, Rule.RUN_ENDED, "ok")
    ]
    assert world.manager.find() == []
    assert world.systemd.timers == {}, "its deadline is disarmed"
    assert [e["SLICEBOX_REAPER_RULE"] for e in world.journal.entries][:1] == ["run_ended"]


def test_a_one_shot_left_by_an_agent_that_died_is_removed_at_the_next_start(
    world: World,
) -> None:
    """The agent died between a run's answer and its removal: the next agent run's first
    pass (its reconciliation) removes the sandbox instead of adopting it."""
    before = SandboxManager(
        world.docker,
        world.slices,
        config=parse_config(""),
        host_memory=8 << 30,
        instance_id="run-before",
        clock=lambda: world.now,
        new_id=lambda: "sbx-left",
        deadlines=Deadlines(world.systemd),
    )
    spec = SandboxSpec.model_validate({"user": "alice", "project": "p"})
    created(before, spec, one_shot=True)  # its run's hold died with that agent
    kept = world.create()
    report = world.reaper.run()
    assert [(a.kind, a.rule, a.target) for a in report.plan] == [
        (Kind.DESTROY, Rule.RUN_ENDED, "sbx-left")
    ]
    assert [o.result for o in report.outcomes] == ["ok"]
    assert [s.id for s in world.manager.find()] == [kept]


def test_with_a_grace_the_slices_outlive_their_last_sandbox_by_that_long(world: World) -> None:
    world.config = world.config.model_copy(update={"empty_slice_grace_seconds": 300})
    units = {"slicebox-alice.slice", "slicebox-alice-p.slice"}

    def pass_at(seconds: int) -> list[str]:
        world.now = NOW + timedelta(seconds=seconds)
        return [a.target for a in world.reaper.run().plan if a.kind is Kind.STOP_SLICE]

    world.manager.destroy(world.create())
    assert [pass_at(s) for s in (0, 30, 150, 299)] == [[], [], [], []]
    assert units <= world.systemd.running
    world.manager.destroy(world.create())  # between passes: the grace starts again
    assert [pass_at(s) for s in (330, 450)] == [[], []]
    assert pass_at(600) == ["slicebox-alice-p.slice", "slicebox-alice.slice"]
    assert not units & world.systemd.running
    assert world.manager.vacated() == {}
    assert pass_at(900) == []


def test_a_destroy_racing_the_reapers_makes_one_removal_and_no_error(world: World) -> None:
    sandbox_id = world.create(ttl_seconds=10)
    world.now = NOW + timedelta(seconds=11) + TIMER_GRACE
    destroyed: list[Sandbox | None] = []

    def caller_destroys_meanwhile(sandbox: Sandbox) -> dict[str, object] | None:
        destroyed.append(world.manager.destroy(sandbox.id))  # while the reaper looks last
        return None

    reaper = Reaper(
        world.manager,
        world.slices,
        world.docker,
        auditor=Auditor(world.journal),
        config=lambda: world.config,
        clock=lambda: world.now,
        final_usage=caller_destroys_meanwhile,
    )
    report = reaper.run()
    assert [(a.kind, o.result) for a, o in zip(report.plan, report.outcomes, strict=True)][:1] == [
        (Kind.DESTROY, "skipped")  # the caller's destroy removed it first
    ]
    assert [s.id for s in destroyed if s is not None] == [sandbox_id]
    assert len(world.docker.removed) == 1
    assert world.manager.find() == []
    assert world.systemd.timers == {}


def test_adoption_happens_once_and_rearms_the_missing_deadline(world: World) -> None:
    world.docker.containers["c-x"] = box("orphan", run="run-old")
    world.systemd.running.add("docker-c-orphan.scope")  # Docker's scope of the container
    first = world.reaper.run()
    assert [(a.kind, o.result) for a, o in zip(first.plan, first.outcomes, strict=True)] == [
        (Kind.ADOPT, "ok"),
        (Kind.ARM_DEADLINE, "ok"),
    ]
    assert world.reaper.adopted == {"orphan"}
    assert world.reaper.run().plan == []


def test_a_deadline_to_rearm_on_a_sandbox_destroyed_since_the_plan_is_skipped_quietly(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Under load the reaper plans from a list a destroy overtakes: a sandbox gone by the time
    its missing timer would be armed again is nothing to do, not a failure."""
    world.docker.containers["c-x"] = box("orphan", run="run-old")  # its timer is missing
    listed = world.docker.find

    def find_then_a_destroy_completes(labels: Mapping[str, str]) -> list[SandboxInfo]:
        found = listed(labels)
        world.docker.containers.pop("c-x", None)  # a caller's destroy, after the list
        return found

    world.docker.find = find_then_a_destroy_completes  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="slicebox.core.reaper"):
        report = world.reaper.run()
    assert [(a.kind, o.result) for a, o in zip(report.plan, report.outcomes, strict=True)] == [
        (Kind.ADOPT, "ok"),
        (Kind.ARM_DEADLINE, "skipped"),
    ]
    assert {r.levelname for r in caplog.records} == {"INFO"}
    assert world.systemd.timers == {}


def test_in_flight_creates_protect_their_slices(world: World) -> None:
    unit = "slicebox-alice-busy.slice"
    ceiling = parse_config("").project_ceiling("alice", "busy", 8 << 30)
    with world.manager.operations.creating(decode(box("sbx-busy", project="busy").labels)):
        world.slices.ensure(unit, ceiling)
        assert world.reaper.run().plan == []
        assert not world.manager.stop_slice_if_idle(unit)
    assert [a.target for a in world.reaper.run().plan] == [unit]
    assert unit not in world.systemd.running


def test_a_create_that_starts_after_the_plan_was_observed_is_not_destroyed(
    world: World,
) -> None:
    """The race of issue 13: the create registers after the reaper snapshotted the creates in
    flight and before it listed containers, so the plan holds its half-made container as
    never started; the check when acting leaves it alone."""
    late = box("sbx-late", status="created")
    creating = contextlib.ExitStack()
    listed = world.docker.find

    def find_while_a_create_starts(labels: Mapping[str, str]) -> list[SandboxInfo]:
        if "sbx-late" not in world.docker.containers:
            creating.enter_context(world.manager.operations.creating(decode(late.labels)))
            world.docker.containers["sbx-late"] = late
        return listed(labels)

    world.docker.find = find_while_a_create_starts  # type: ignore[method-assign]
    with creating:
        report = world.reaper.run()
        assert [(a.kind, a.rule, a.target) for a in report.plan] == [
            (Kind.DESTROY, Rule.NEVER_STARTED, "sbx-late")
        ]
        assert [o.result for o in report.outcomes] == ["deferred"]
        assert "sbx-late" in world.docker.containers
    assert [e["SLICEBOX_RESULT"] for e in world.journal.entries] == ["deferred"]


def test_no_reaper_action_while_an_exec_or_destroy_is_in_flight(world: World) -> None:
    sandbox_id = world.create(ttl_seconds=10)
    world.now = NOW + timedelta(seconds=11) + TIMER_GRACE  # the fake timers never fire
    with world.manager.operation(sandbox_id):  # an exec, say, still running
        report = world.reaper.run()
        assert [(a.kind, o.result) for a, o in zip(report.plan, report.outcomes, strict=True)][
            :1
        ] == [(Kind.DESTROY, "deferred")]
        assert [s.id for s in world.manager.find()] == [sandbox_id]
    with world.manager.claim(sandbox_id) as free:
        assert free
        with world.manager.claim(sandbox_id) as again:
            assert not again, "one claim at a time"
    assert [o.result for o in world.reaper.run().outcomes][:1] == ["ok"]
    assert world.manager.find() == []


def test_arm_disarm_and_a_deadline_read_ask_systemd_for_the_sandbox_s_own_timers(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their answer must not grow with the number of sandboxes: no listing of every timer."""
    others = [world.create(ttl_seconds=600) for _ in range(3)]
    patterns: list[str] = []
    list_units = world.systemd.list_units

    def recording(pattern: str, *, active_only: bool = False) -> list[str]:
        patterns.append(pattern)
        return list_units(pattern, active_only=active_only)

    monkeypatch.setattr(world.systemd, "list_units", recording)
    sandbox_id = world.create(ttl_seconds=60)
    world.manager.extend(sandbox_id, 120)
    assert world.manager.get(sandbox_id, current_deadline=True).expires_at == NOW + timedelta(
        seconds=120
    )
    world.manager.destroy(sandbox_id)
    timer_patterns = [p for p in patterns if p.endswith(".timer")]
    assert timer_patterns, "the deadline steps looked for timers"
    assert all(sandbox_id in p for p in timer_patterns), timer_patterns
    assert {t.sandbox_id for t in Deadlines(world.systemd).timers()} == set(others)


def test_the_timer_passes_the_agent_s_engine_to_the_expiry() -> None:
    at = NOW + timedelta(seconds=60)
    plain = expire_command("/usr/bin/sliceboxd", "sbx-a", "c1", at)
    assert plain[:2] == ["/usr/bin/sliceboxd", "expire"]
    try:  # an engine that names its scopes otherwise (Podman) says so to the expiry
        use_scope_prefix(PODMAN_SCOPES)
        podman = expire_command("/usr/bin/sliceboxd", "sbx-a", "c1", at)
    finally:
        use_scope_prefix(DOCKER_SCOPES)
    assert podman[:3] == ["/usr/bin/env", f"{SCOPE_PREFIX_ENV}=libpod", "/usr/bin/sliceboxd"]
    remote = expire_command("/usr/bin/sliceboxd", "sbx-a", "c1", at, "tcp://d:2375")
    assert remote[:4] == [
        "/usr/bin/env",
        "DOCKER_HOST=tcp://d:2375",
        "/usr/bin/sliceboxd",
        "expire",
    ]
