"""Remote (daytona) sandboxes through the agent's own parts: the create path, the router, the
exec engine and the reaper, with the real Daytona SDK against the local stand-in
(``tests.fakes.daytona``, answers built from the SDK's models) and fakes of systemd and Docker
for the rest. Verified against that contract, not against the service (README)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from slicebox.backends import daytona as backend_module
from slicebox.backends.daytona import DaytonaBackend, is_daytona_id
from slicebox.backends.router import Backends
from slicebox.core.blocking import on_core_loop
from slicebox.core.deadlines import Deadlines
from slicebox.core.execution import ExecEngine
from slicebox.core.reaper import Reaper
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.journal import Auditor
from slicebox.model.config import DaytonaConfig, ReaperConfig, parse_config
from slicebox.model.errors import InvalidRequest, Unavailable
from slicebox.model.exec import ExecRequest
from slicebox.model.reaper import Rule
from slicebox.model.spec import Backend, SandboxSpec
from tests.fakes.daytona import StandIn, running
from tests.fakes.docker import FakeDocker
from tests.fakes.journal import ListJournal
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import created

KEY = "dtn_agent-test-key-fedcba9876543210"
NOW = datetime(2026, 12, 5, 8, 0, 0, tzinfo=UTC)
RUN = "run-remote"


@pytest.fixture(scope="module", autouse=True)
def _sdk_imported() -> None:
    backend_module.import_sdk()  # most of a second, paid once


class NoHost:
    """The engine's host side, for a sandbox that has none here: any call is a bug."""

    def __getattr__(self, name: str) -> object:
        if name == "process_clock":
            return lambda: 0
        raise AssertionError(f"a remote exec asked the host for {name}")


class World:
    def __init__(self, stand_in: StandIn, tmp: Path) -> None:
        self.now = NOW
        self.systemd = FakeSystemd()
        self.docker = FakeDocker(self.systemd)
        self.remote = DaytonaBackend(stand_in.api_url, KEY, portal=on_core_loop)
        self.backends = Backends(self.docker, None, daytona=self.remote)
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.manager = SandboxManager(
            self.backends,
            SliceManager(self.systemd),
            config=parse_config('default_image = "debian:12"'),
            host_memory=8 << 30,
            instance_id=RUN,
            clock=lambda: self.now,
            new_id=lambda: next(ids),
            deadlines=Deadlines(self.systemd, program=lambda: "/usr/bin/sliceboxd"),
        )
        self.journal = ListJournal()
        self.reaper = Reaper(
            self.manager,
            SliceManager(self.systemd),
            self.backends,
            auditor=Auditor(self.journal),
            config=lambda: ReaperConfig(state_dir=tmp / "state", empty_slice_grace_seconds=0),
            clock=lambda: self.now,
        )
        self.engine = ExecEngine(self.backends, NoHost())  # type: ignore[arg-type]

    def spec(self, **fields: object) -> SandboxSpec:
        base = {"user": "alice", "project": "remote", "backend": "daytona"}
        return SandboxSpec.model_validate(base | fields)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with running(KEY) as stand_in:
        world = World(stand_in, tmp_path)
        yield world
        on_core_loop(world.remote.aclose)  # the core loop's client, which every call here used


def test_a_remote_sandbox_is_made_listed_and_destroyed_by_its_labels(world: World) -> None:
    made = created(world.manager, world.spec(ttl_seconds=600, memory="1GB"))
    assert made.backend == "daytona"
    assert is_daytona_id(made.container_id)
    [info] = world.remote.find({"slicebox.sandbox_id": made.id})
    assert info.labels["slicebox.user"] == "alice"
    assert info.labels["slicebox.instance_id"] == RUN
    assert [s.id for s in world.manager.find(user="alice")] == [made.id]
    assert world.manager.get(made.id).container_id == made.container_id
    assert not world.systemd.timers, "no unit here to bind a deadline timer to"
    assert world.manager.destroy(made.id) is not None
    assert world.remote.find({"slicebox.sandbox_id": made.id}) == []
    assert world.manager.destroy(made.id) is None, "twice is fine"


def test_an_exec_runs_remotely_and_never_asks_this_host(world: World) -> None:
    made = created(world.manager, world.spec())
    ran = world.engine.run(made.container_id, ExecRequest(argv=("sh", "-c", "echo hi; exit 3")))
    assert (ran.exit_code, ran.stdout) == (3, b"hi\n")
    fed = world.engine.run(made.container_id, ExecRequest(argv=("cat",), stdin=b"in\x00put"))
    assert fed.stdout == b"in\x00put"
    slow = world.engine.run(made.container_id, ExecRequest(argv=("sleep", "30"), timeout=1))
    assert (slow.exit_code, slow.timed_out) == (124, True)
    world.manager.destroy(made.id)


def test_the_reaper_expires_a_remote_sandbox_by_its_label_with_its_children(
    world: World,
) -> None:
    parent = created(world.manager, world.spec(ttl_seconds=60))
    child = created(world.manager, world.spec(parent_id=parent.id, ttl_seconds=3600))
    plan = world.reaper.run(dry_run=True).plan
    assert not [a for a in plan if a.rule is Rule.DEADLINE_MISSING], "the label's holds"
    world.now = NOW + timedelta(seconds=61)
    report = world.reaper.run()
    rules = {a.sandbox_id: a.rule for a in report.plan if a.sandbox_id}
    assert rules[parent.id] is Rule.EXPIRED
    assert child.id in rules, "its child goes with it (cascade)"
    assert {o.result for o in report.outcomes} == {"ok"}
    assert world.remote.find({"slicebox.user": "alice"}) == []
    entries = [e for e in world.journal.entries if "SLICEBOX_SANDBOX_ID" in e]
    audited = {e["SLICEBOX_SANDBOX_ID"]: e["SLICEBOX_REAPER_RULE"] for e in entries}
    assert audited[parent.id] == "expired", "each removal audited with its rule"
    assert child.id in audited


def test_another_agent_s_remote_sandbox_is_found_by_the_reaper(world: World) -> None:
    other = SandboxManager(
        world.backends,
        SliceManager(world.systemd),
        config=parse_config('default_image = "debian:12"'),
        host_memory=8 << 30,
        instance_id="run-before",
        clock=lambda: world.now,
    )
    orphan = created(other, world.spec())
    report = world.reaper.run(dry_run=True)
    assert orphan.id in {a.sandbox_id for a in report.plan}, report.plan
    world.manager.destroy(orphan.id)


def test_what_a_remote_sandbox_cannot_give_is_refused_before_anything_is_made(
    world: World,
) -> None:
    for extra in ({"network": "bridge"}, {"cap_add": ["NET_ADMIN"]}, {"reuse": True}):
        with pytest.raises(InvalidRequest) as refused:
            created(world.manager, world.spec(**extra))
        assert refused.value.code == "backend_unsupported"
        assert "daytona sandbox" in refused.value.message
    assert world.remote.find({}) == []
    made = created(world.manager, world.spec(ttl_seconds=60))
    with pytest.raises(InvalidRequest) as extend:
        world.manager.extend(made.id, 600)
    assert extend.value.code == "backend_unsupported"
    world.manager.destroy(made.id)


def test_a_daytona_that_does_not_answer_is_left_out_of_listings(tmp_path: Path) -> None:
    with running(KEY) as stand_in:
        world = World(stand_in, tmp_path)
        docker_made = created(world.manager, world.spec(backend="docker", image="alpine:3.19"))
    # The stand-in is gone: listings go on with what answers; a create there is refused.
    assert [s.id for s in world.manager.find(user="alice")] == [docker_made.id]
    with pytest.raises(Unavailable) as down:
        created(world.manager, world.spec())
    assert down.value.code == "backend_unavailable"
    assert KEY not in down.value.message
    on_core_loop(world.remote.aclose)


def test_an_agent_without_daytona_refuses_it_and_a_key_file_is_checked(tmp_path: Path) -> None:
    backends = Backends(FakeDocker(FakeSystemd()), None)
    with pytest.raises(Unavailable, match=r"\[daytona\]"):
        backends.resolve(Backend.DAYTONA, fallback=True)
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o644)
    config = DaytonaConfig(api_url="https://daytona.internal/api", api_key_file=key)
    with pytest.raises(ValueError, match="chmod 600"):
        config.api_key()
    key.chmod(0o600)
    assert config.api_key() == KEY


def test_doctor_reports_the_remote_backend(tmp_path: Path) -> None:
    from slicebox.cli import doctor

    config = tmp_path / "config.toml"
    config.write_text("")
    host = doctor.Host(config=config)
    unused = doctor.check_daytona(host)
    assert unused.state is doctor.State.OK
    assert "not configured" in unused.detail, "nothing is wrong with an optional backend unused"
    key = tmp_path / "key"
    key.write_text(KEY)
    key.chmod(0o600)
    with running(KEY) as stand_in:
        config.write_text(f'[daytona]\napi_url = "{stand_in.api_url}"\napi_key_file = "{key}"\n')
        found = doctor.check_daytona(host)
        assert found.state is doctor.State.OK, found
    down = doctor.check_daytona(host)
    assert down.state is doctor.State.FAIL
    assert KEY not in down.detail
