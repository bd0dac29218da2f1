"""The warm pool over fakes: exact keys, refill off the request's thread, leases that survive a
restart, release, headroom, and the reaper's pool rules."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from slicebox.core.creation import KEEP_ALIVE
from slicebox.core.deadlines import Deadlines
from slicebox.core.launch import LAUNCHER, WAITER_COMMAND
from slicebox.core.pool import WarmPool
from slicebox.core.reaper import Reaper
from slicebox.core.reaping import Observed, plan
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.service import Service
from slicebox.core.slices import SliceManager
from slicebox.core.telemetry import TreeReader, UsageReader
from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.api import CreateSandbox
from slicebox.model.config import ReaperConfig, parse_config
from slicebox.model.errors import NotFound
from slicebox.model.reaper import Kind, Rule
from slicebox.model.spec import SandboxSpec
from tests.fakes.docker import FakeDocker
from tests.fakes.journal import ListJournal
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import ThreadSide, created

MiB = 1024 * 1024
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
ALICE = Identity(uid=1000, gid=1000, pid=11, user_name="alice", is_admin=False)
POOL = """
allowed_networks = ["none", "bridge"]
[projects."alice/web"]
memory = "1GB"
[[pool]]
user = "alice"
project = "web"
size = 2
memory = "128MB"
idle_timeout_seconds = 600
"""
REUSE = POOL.replace("size = 2", "size = 1\nreuse = true")


class Queue:
    """An executor that runs nothing until told: a refill's work stays off the request."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        self.jobs.append((function, args))
        return Future()

    def drain(self) -> int:
        ran = 0
        while self.jobs:
            function, args = self.jobs.pop(0)
            function(*args)
            ran += 1
        return ran


class FakeReset:
    def __init__(self) -> None:
        self.healthy = True
        self.resets: list[tuple[str, int]] = []

    def mark(self) -> int:
        return 77

    def reset(self, sandbox: Sandbox, since: int) -> bool:
        self.resets.append((sandbox.id, since))
        return self.healthy


class World:
    def __init__(self, tmp: Path, config: str = POOL) -> None:
        self.tmp = tmp
        self.systemd = FakeSystemd()
        self.docker = FakeDocker(self.systemd)
        self.ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.now = NOW
        self.config = parse_config(config)
        self.queue = Queue()
        self.reset = FakeReset()
        self.dead: set[str] = set()  # members whose processes are gone (their scope is empty)
        self.mono = 0.0  # the pool's own clock (seconds)
        self.start("run-1")

    def start(self, instance_id: str) -> None:
        """An agent run over the same Docker and systemd (a restart after a ``kill -9``)."""
        self.manager = SandboxManager(
            self.docker,
            SliceManager(self.systemd),
            config=self.config,
            host_memory=4096 * MiB,
            instance_id=instance_id,
            clock=lambda: self.now,
            new_id=lambda: next(self.ids),
            deadlines=Deadlines(self.systemd),
        )
        self.pool = WarmPool(
            self.manager,
            reset=self.reset,
            executor=self.queue,  # type: ignore[arg-type]
            now=self.clock,
            clock=lambda: self.mono,
            alive=lambda member: member.container_id not in self.dead,
        )
        self.reaper = Reaper(
            self.manager,
            SliceManager(self.systemd),
            self.docker,
            auditor=Auditor(ListJournal()),
            config=lambda: ReaperConfig(state_dir=self.tmp / "state"),
            clock=self.clock,
            pool=self.pool,
        )
        self.service = Service(
            self.manager,
            None,  # type: ignore[arg-type]  # no exec here
            usage=UsageReader(CgroupFS(self.tmp)),
            tree=TreeReader(CgroupFS(self.tmp)),
            auditor=Auditor(ListJournal()),
            pid_of=lambda sandbox: None,
            clock=self.clock,
            pool=self.pool,
        )

    def clock(self) -> datetime:
        return self.now

    def fill(self) -> None:
        self.pool.kick()
        self.queue.drain()

    def members(self) -> list[Sandbox]:
        return self.manager.find(pool="true")


@pytest.fixture
def world(tmp_path: Path) -> World:
    world = World(tmp_path)
    world.fill()
    return world


def spec(**fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate(
        {"user": "alice", "project": "web", "memory": "128MB", **fields}
    )


def test_members_are_made_for_their_key_in_their_project_slice(world: World) -> None:
    members = world.members()
    assert [m.pool_state for m in members] == ["idle", "idle"]
    (fingerprint,) = {m.lineage.pool_key for m in members}
    assert fingerprint == world.pool.stats().pools[0].fingerprint
    request = world.docker.requests[members[0].container_id]
    assert request.slice == "slicebox-alice-web.slice"
    assert (request.network, request.cap_add, request.user) == ("none", (), "65534:65534")
    assert request.limits.memory_bytes == 128 * MiB
    assert members[0].expires_at is None, "no deadline until acquired"
    assert world.systemd.timers == {}
    # A run that takes it hands its command to its waiter; a create keeps it waiting.
    assert (request.command, request.open_stdin) == (WAITER_COMMAND, True)
    assert members[0].lineage.launcher == LAUNCHER


@pytest.mark.parametrize(
    "differs",
    [
        {"memory": "256MB"},
        {"network": "bridge"},
        {"project": "api"},
        {"cpus": 1},
        {"pids": 50},
        {"image": "busybox"},
        {"run_as": "1000:1000"},
        {"env": {"A": "1"}},
        {"command": ["sh"]},
        {"cap_add": ["CHOWN"]},
        {"reuse": True},
    ],
)
def test_a_request_whose_settings_differ_never_gets_a_member(
    world: World, differs: dict[str, object]
) -> None:
    world.docker.images.add("busybox")
    before = {m.id for m in world.members()}
    made = ThreadSide(world.service).create(
        ALICE, CreateSandbox.model_validate({"project": "web", "memory": "128MB", **differs})
    )
    assert made.id not in before
    assert made.pool == ""
    assert {m.id for m in world.members()} == before, "the idle members are untouched"
    stats = world.pool.stats()
    assert (stats.cold, stats.pools[0].hits) == (1, 0)


def test_a_request_of_the_key_takes_a_ready_member_and_the_refill_runs_elsewhere(
    world: World,
) -> None:
    created = world.docker.created
    view = ThreadSide(world.service).create(
        ALICE, CreateSandbox(project="web", memory="128MB", task_id="t1", ttl_seconds=60)
    )
    assert view.pool == "acquired"
    assert world.docker.created == created, "nothing was created for the request"
    assert (view.task_id, view.root_task_id, view.parent_id) == ("t1", "t1", "")
    assert view.expires_at == NOW + timedelta(seconds=60)
    stats = world.pool.stats().pools[0]
    assert (stats.ready, stats.busy, stats.hits, stats.hit_rate) == (1, 1, 1, 1.0)
    assert world.queue.jobs, "the refill is queued, not run on the request's thread"
    world.queue.drain()
    assert world.docker.created == created + 1
    assert world.pool.stats().pools[0].ready == 2
    assert world.pool.stats().pools[0].refill_seconds_last is not None


def test_a_member_that_died_while_idle_is_replaced_never_handed_out(world: World) -> None:
    oldest, younger = world.members()
    world.dead.add(oldest.container_id)  # say, OOM-killed or killed by hand while idle
    view = ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    assert (view.id, view.pool) == (younger.id, "acquired")
    cold = ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    assert cold.id not in (oldest.id, younger.id)
    assert cold.pool == "", "none was ready: created cold"
    world.queue.drain()  # the dead one is destroyed, the pool filled again
    ids = {m.id for m in world.members()}
    assert oldest.id not in ids
    assert world.pool.stats().pools[0].ready == 2


def test_an_empty_pool_is_a_miss_and_the_request_is_created_cold(world: World) -> None:
    for _ in range(3):
        ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    stats = world.pool.stats().pools[0]
    assert (stats.hits, stats.misses, stats.ready) == (2, 1, 0)
    assert stats.hit_rate == pytest.approx(2 / 3)


def test_an_idle_member_is_no_one_s_to_use(world: World) -> None:
    idle = world.members()[0]
    with pytest.raises(NotFound):
        ThreadSide(world.service).get(ALICE, idle.id)
    listed = {v.id: v.pool for v in ThreadSide(world.service).list_sandboxes(ALICE)}
    assert listed[idle.id] == "idle"
    assert not ThreadSide(world.service).destroy(ALICE, idle.id).destroyed
    assert ThreadSide(world.service).destroy_tree(ALICE, idle.id) == [], (
        "its label task id is no task's"
    )
    assert idle.id in {m.id for m in world.members()}


def test_an_acquired_member_s_lineage_survives_a_restart_from_systemd_alone(
    world: World,
) -> None:
    parent = ThreadSide(world.service).create(
        ALICE, CreateSandbox(project="api", root_task_id="root-7")
    )
    child = ThreadSide(world.service).create(
        ALICE, CreateSandbox(project="web", memory="128MB", parent_id=parent.id, task_id="t2")
    )
    assert child.pool == "acquired"
    world.start("run-2")  # kill -9: nothing in memory survives
    again = ThreadSide(world.service).get(ALICE, child.id)
    assert (again.root_task_id, again.task_id, again.parent_id, again.depth) == (
        "root-7",
        "t2",
        parent.id,
        1,
    )
    assert {s.id for s in world.manager.find(root_task_id="root-7")} == {parent.id, child.id}
    assert world.pool.adopt() == 1, "the idle member is taken back; the acquired one is not"
    report = world.reaper.run()
    assert [a for a in report.plan if a.kind is Kind.DESTROY] == []
    destroyed = [d.id for d in ThreadSide(world.service).destroy_tree(ALICE, "root-7")]
    assert destroyed == [child.id, parent.id], "deepest first, found by its lease"
    assert world.systemd.timers == {}, "the lease went with its container"


def test_extending_an_acquired_member_keeps_its_lease(world: World) -> None:
    view = ThreadSide(world.service).create(
        ALICE, CreateSandbox(project="web", memory="128MB", task_id="t3")
    )
    world.manager.extend(view.id, 7200)
    world.start("run-2")
    again = ThreadSide(world.service).get(ALICE, view.id)
    assert (again.task_id, again.expires_at) == ("t3", NOW + timedelta(seconds=7200))


def test_a_release_destroys_the_member_and_only_then_its_lease(world: World) -> None:
    view = ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    container = view.container_id
    assert ThreadSide(world.service).destroy(ALICE, view.id).destroyed
    assert container in world.docker.removed
    assert world.systemd.timers == {}
    assert world.reset.resets == [], "no reuse without asking"


def test_a_failed_removal_leaves_the_member_leased_not_idle(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    view = ThreadSide(world.service).create(
        ALICE, CreateSandbox(project="web", memory="128MB", task_id="t4")
    )
    monkeypatch.setattr(world.docker, "remove", lambda container_id: False)
    ThreadSide(world.service).destroy(ALICE, view.id)
    assert world.manager.get(view.id).pool_state == "acquired", "a used member never looks idle"


def test_a_reuse_member_comes_back_reset_and_only_to_reuse_requests(tmp_path: Path) -> None:
    world = World(tmp_path, REUSE)
    world.fill()
    [idle] = world.members()
    request = world.docker.requests[idle.container_id]
    assert (request.command, request.open_stdin) == (KEEP_ALIVE, False), "its waiter would be used"
    assert idle.lineage.launcher == ""
    first = ThreadSide(world.service).create(
        ALICE, CreateSandbox(project="web", memory="128MB", reuse=True)
    )
    assert first.pool == "acquired"
    assert ThreadSide(world.service).destroy(ALICE, first.id).destroyed
    assert world.reset.resets == [(first.id, 77)], "killed since its acquire mark"
    assert world.systemd.timers == {}, "its lease is gone: it is idle"
    plain = ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    assert plain.id != first.id, "a request without reuse never gets a used member"
    again = ThreadSide(world.service).create(
        ALICE, CreateSandbox(project="web", memory="128MB", reuse=True)
    )
    assert again.id == first.id
    world.reset.healthy = False
    ThreadSide(world.service).destroy(ALICE, again.id)
    assert again.container_id in world.docker.removed, "an unhealthy member is replaced"


def test_members_never_fill_the_project_past_its_memory_ceiling(tmp_path: Path) -> None:
    config = POOL.replace('memory = "1GB"', 'memory = "400MB"').replace("size = 2", "size = 5")
    world = World(tmp_path, config)
    created(world.manager, spec(project="web", memory="100MB"))
    world.fill()
    stats = world.pool.stats().pools[0]
    assert stats.ready == 2, "100 + 2 x 128 MB fit under 400 MB; a third would not"
    assert "MiB of memory left under its ceiling" in stats.held_back


def test_a_pool_whose_creates_are_refused_says_why_once_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    world = World(tmp_path)
    world.docker.images.clear()  # its image is not on the host (and cannot be pulled)
    with caplog.at_level(logging.DEBUG, logger="slicebox.core.pool"):
        for _ in range(3):  # three refills, as the reaper's passes would ask
            world.fill()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, "said once, not at every refill"
    assert "image_unavailable" in warned[0].getMessage()
    assert not any(r.exc_info for r in caplog.records), "a refusal is no traceback"
    stats = world.pool.stats().pools[0]
    assert (stats.ready, stats.creating) == (0, 0)
    assert "cannot be pulled" in stats.held_back, "the pool's stats say why it stays empty"

    world.docker.images.add("alpine:3.19")  # pulled by the operator
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slicebox.core.pool"):
        world.fill()
    assert "makes members again" in caplog.text
    stats = world.pool.stats().pools[0]
    assert (stats.ready, stats.held_back) == (2, "")


def test_the_reaper_trims_idle_members_past_their_timeout_and_size_never_acquired_ones(
    world: World,
) -> None:
    taken = ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    world.queue.drain()  # the refill: two idle members again
    waiting = {m.id for m in world.members() if m.pool_state == "idle"}
    world.now = NOW + timedelta(seconds=700)
    world.queue.jobs.clear()
    report = world.reaper.run()
    idle = {a.target for a in report.plan if a.rule is Rule.POOL_IDLE}
    assert idle == waiting
    assert len(idle) == 2
    assert taken.id not in idle
    assert [m.id for m in world.members()] == [taken.id]
    assert world.pool.stats().pools[0].ready == 0, "withdrawn from the pool first"


def test_surplus_idle_members_of_an_undeclared_key_go_an_acquired_one_stays(
    world: World,
) -> None:
    taken = ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    world.config = parse_config("")
    world.start("run-2")  # the [[pool]] table was removed meanwhile
    report = world.reaper.run()
    surplus = {a.target for a in report.plan if a.rule is Rule.POOL_SURPLUS}
    assert len(surplus) == 1
    assert taken.id not in surplus
    assert world.manager.get(taken.id).pool_state == "acquired"


def test_an_idle_member_being_acquired_is_deferred_by_the_reaper(world: World) -> None:
    member = world.members()[0]
    observed = Observed(
        instance_id="run-1",
        containers=world.docker.find({}),
        pools={member.lineage.pool_key: (0, 600.0)},
    )
    (action, *_) = [a for a in plan(observed, NOW, ReaperConfig()) if a.target == member.id]
    assert action.rule is Rule.POOL_SURPLUS
    taking = world.pool._pools[next(iter(world.pool._pools))]  # an acquire under way
    taking.acquiring.add(member.id)
    outcome = world.reaper._carry_out(action)
    assert outcome.result == "deferred"
    assert member.id in {m.id for m in world.members()}


LEARNING = """
[projects."alice/web"]
memory = "1GB"
[pool_learning]
enabled = true
uses = 2
window_seconds = 60
size = 1
max_pools = 1
"""


def cold_create(world: World, **fields: object) -> str:
    body = {"project": "web", "memory": "128MB", **fields}
    return ThreadSide(world.service).create(ALICE, CreateSandbox.model_validate(body)).id


def test_a_key_asked_for_enough_within_the_window_gets_a_pool_of_its_own(tmp_path: Path) -> None:
    world = World(tmp_path, LEARNING)
    cold_create(world)
    world.mono += 30
    world.fill()
    assert world.pool.stats().pools == [], "asked for once: nothing learned yet"
    cold_create(world)
    world.fill()
    [learned] = world.pool.stats().pools
    assert (learned.learned, learned.size, learned.ready) == (True, 1, 1)
    assert learned.key.limits.memory_bytes == 128 * MiB
    member = next(m for m in world.members() if m.pool_state == "idle")
    assert member.lineage.launcher == LAUNCHER
    third = ThreadSide(world.service).create(ALICE, CreateSandbox(project="web", memory="128MB"))
    assert (third.id, third.pool) == (member.id, "acquired"), "the next request takes it"
    assert world.pool.stats().pools[0].hits == 1


def test_requests_far_apart_or_of_other_keys_teach_nothing(tmp_path: Path) -> None:
    world = World(tmp_path, LEARNING)
    cold_create(world)
    world.mono += 61  # past the window: the first one no longer counts
    cold_create(world)
    cold_create(world, memory="256MB")
    cold_create(world, cap_add=["CHOWN"])
    cold_create(world, cap_add=["CHOWN"])  # a key a [[pool]] table cannot say: never learned
    world.fill()
    assert world.pool.stats().pools == []
    assert world.members() == []


def test_learning_is_off_unless_enabled(tmp_path: Path) -> None:
    world = World(tmp_path, LEARNING.replace("enabled = true", "enabled = false"))
    for _ in range(3):
        cold_create(world)
    world.fill()
    assert world.pool.stats().pools == []


def test_a_learned_pool_nobody_asks_for_is_forgotten_and_its_member_trimmed(
    tmp_path: Path,
) -> None:
    world = World(tmp_path, LEARNING)
    cold_create(world)
    cold_create(world)
    world.fill()
    [member] = [m for m in world.members() if m.pool_state == "idle"]
    world.mono += 30
    world.reaper.run()
    assert member.id in {m.id for m in world.members()}, "asked for within the window: kept"
    world.mono += 61
    report = world.reaper.run()
    assert {a.target for a in report.plan if a.rule is Rule.POOL_SURPLUS} == {member.id}
    assert world.pool.stats().pools == []
    assert member.id not in {m.id for m in world.members()}


def test_learned_pools_stop_at_max_pools_and_never_past_the_project_ceiling(
    tmp_path: Path,
) -> None:
    config = LEARNING.replace('memory = "1GB"', 'memory = "300MB"').replace("size = 1", "size = 3")
    world = World(tmp_path, config)
    for _ in range(2):
        cold_create(world, memory="64MB")
    for _ in range(2):
        cold_create(world, memory="32MB")  # max_pools = 1: this key is not learned
    world.fill()
    [learned] = world.pool.stats().pools
    assert learned.key.limits.memory_bytes == 64 * MiB
    # 4 running sandboxes (192 MiB) leave 108 MiB: one 64 MiB member fits of the 3 asked.
    assert (learned.size, learned.ready) == (3, 1)
    assert "left under its ceiling" in learned.held_back


def test_a_reload_keeps_what_was_learned_and_a_table_of_the_key_takes_it_over(
    tmp_path: Path,
) -> None:
    world = World(tmp_path, LEARNING)
    cold_create(world)
    cold_create(world)
    world.fill()
    world.pool.configure(parse_config(LEARNING))
    assert [p.learned for p in world.pool.stats().pools] == [True]
    declared = LEARNING + '[[pool]]\nuser = "alice"\nproject = "web"\nsize = 2\nmemory = "128MB"\n'
    world.pool.configure(parse_config(declared))
    [pool] = world.pool.stats().pools
    assert (pool.learned, pool.size, pool.ready) == (False, 2, 1), "its member kept"
    world.pool.configure(parse_config(LEARNING.replace("enabled = true", "enabled = false")))
    assert world.pool.stats().pools == []
