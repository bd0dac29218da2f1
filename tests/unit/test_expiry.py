"""The expiry the deadline timer runs (``sliceboxd expire``), over fakes and a cgroupfs tree."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from slicebox.core.deadlines import Deadlines, timer_unit
from slicebox.core.expiry import Expiry, Result
from slicebox.core.reaper import Reaper
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.core.telemetry import UsageReader
from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.journal import Auditor
from slicebox.model.config import ReaperConfig, parse_config
from slicebox.model.errors import HostError
from slicebox.model.reaper import Kind, Rule
from slicebox.model.spec import SandboxSpec
from tests.fakes.docker import FakeDocker
from tests.fakes.journal import ListJournal
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import created

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
PROJECT_CGROUP = "slicebox.slice/slicebox-alice.slice/slicebox-alice-p.slice"


class Host:
    """The agent's parts over fakes, a clock and a cgroupfs tree the sandboxes' counters sit in."""

    def __init__(self, tmp: Path) -> None:
        self.now = NOW
        self.cgroupfs = tmp
        self.systemd = FakeSystemd()
        self.docker = FakeDocker(self.systemd)
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.manager = SandboxManager(
            self.docker,
            SliceManager(self.systemd),
            config=parse_config(""),
            host_memory=8 << 30,
            instance_id="run-now",
            clock=lambda: self.now,
            new_id=lambda: next(ids),
            deadlines=Deadlines(self.systemd),
        )
        self.journal = ListJournal()
        self.expiry = Expiry(
            self.manager,
            self.docker,
            self.systemd,
            usage=UsageReader(CgroupFS(tmp)),
            auditor=Auditor(self.journal),
            clock=lambda: self.now,
        )

    def create(self, ttl: int = 60, project: str = "p") -> tuple[str, str]:
        spec = {"user": "alice", "project": project, "ttl_seconds": ttl}
        sandbox = created(self.manager, SandboxSpec.model_validate(spec))
        for level in ("slicebox.slice", *_parents(project)):
            _write(self.cgroupfs / level, {"memory.current": "4096\n"})
        _write(
            self.cgroupfs / _parents(project)[-1] / f"docker-{sandbox.container_id}.scope",
            {
                "memory.current": "2048\n",
                "cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n",
                "io.stat": "254:0 rbytes=0 wbytes=8192 rios=0 wios=2\n",
            },
        )
        return sandbox.id, sandbox.container_id

    def expired(self) -> list[Mapping[str, str]]:
        return [e for e in self.journal.entries if e.get("SLICEBOX_REAPER_RULE") == "expired"]


def _parents(project: str) -> tuple[str, str]:
    user = "slicebox.slice/slicebox-alice.slice"
    return user, f"{user}/slicebox-alice-{project}.slice"


def _write(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def test_the_expiry_audits_the_final_usage_before_it_removes(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)
    present_when_audited: list[bool] = []
    send = host.journal.send

    def send_and_look(fields: Mapping[str, str]) -> None:
        present_when_audited.append(container in host.docker.containers)
        send(fields)

    host.journal.send = send_and_look  # type: ignore[method-assign]
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.EXPIRED
    [record] = host.journal.entries
    assert present_when_audited == [True], "the counters were read while the cgroup was there"
    assert record["SLICEBOX_EVENT"] == "reaper_action"
    assert record["SLICEBOX_REAPER_RULE"] == "expired"
    assert record["SLICEBOX_RESULT"] == "ok"
    assert record["SLICEBOX_SANDBOX_ID"] == sandbox_id
    assert (record["SLICEBOX_USER"], record["SLICEBOX_PROJECT"]) == ("alice", "p")
    assert record["SLICEBOX_ROOT_TASK_ID"] == sandbox_id
    assert float(record["SLICEBOX_USAGE_CPU_SECONDS"]) == 1.5
    assert record["SLICEBOX_USAGE_DISK_BYTES_WRITTEN"] == "8192"
    assert record["SLICEBOX_USAGE_SANDBOX_DELETED_AT"].startswith("2026-01-02T03:05:05")
    assert "deadline timer" in record["SLICEBOX_DETAIL"]
    assert host.docker.containers == {}, "killed and removed"
    # The slices are the agent's reaper's to stop, past their grace: this process cannot see
    # the agent's creates in flight into them.
    assert "slicebox-alice-p.slice" in host.systemd.running


def test_a_second_run_finds_nothing_and_writes_nothing(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.EXPIRED
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.GONE
    assert len(host.journal.entries) == 1


def test_a_destroyed_or_exited_sandbox_is_left_to_the_reaper(host: Host) -> None:
    gone, gone_container = host.create(ttl=60)
    host.manager.destroy(gone)
    exited, exited_container = host.create(ttl=60, project="q")
    host.docker.stop(exited_container)
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(gone, gone_container, deadline) is Result.GONE
    assert host.expiry.expire(exited, exited_container, deadline) is Result.IDLE
    assert host.journal.entries == []
    assert exited_container in host.docker.containers


def test_a_timer_left_from_before_an_extension_does_not_kill(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)
    host.now = NOW + timedelta(seconds=30)
    host.manager.extend(sandbox_id, 600)
    host.now = first = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, first) is Result.NOT_DUE
    assert host.expiry.expire(sandbox_id, container) is Result.NOT_DUE, "run by hand, too early"
    assert container in host.docker.containers
    assert host.journal.entries == []
    assert host.systemd.killed == []
    later = NOW + timedelta(seconds=630)
    assert list(host.systemd.timers) == [timer_unit(sandbox_id, later)], "the extension holds"


def test_the_expiry_stops_an_unbound_timer_and_its_own_goes_with_the_scope(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)
    own = timer_unit(sandbox_id, NOW + timedelta(seconds=60))
    assert host.systemd.bound == {own: f"docker-{container}.scope"}
    earlier = NOW + timedelta(seconds=50)  # armed by an agent that bound no timer to its scope
    host.systemd.start_timer(timer_unit(sandbox_id, earlier), earlier, ["true"], "left over")
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.EXPIRED
    assert ("stop", own) not in host.systemd.calls, "never the unit that runs this command"
    assert host.systemd.timers == {}


def test_docker_down_kills_the_scope_through_systemd_and_still_audits(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)
    host.docker.down = "connection refused"
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.KILLED
    assert host.systemd.killed == [(f"docker-{container}.scope", signal.SIGKILL)]
    [record] = host.expired()
    assert record["SLICEBOX_SANDBOX_ID"] == sandbox_id
    assert (record["SLICEBOX_USER"], record["SLICEBOX_PROJECT"]) == ("alice", "p")
    assert float(record["SLICEBOX_USAGE_CPU_SECONDS"]) == 1.5
    assert "Docker did not answer" in record["SLICEBOX_DETAIL"]
    host.docker.down = None
    host.docker.stop(container)  # what Docker shows once its processes were killed
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.IDLE, "no second record"
    assert len(host.journal.entries) == 1


def test_docker_down_with_no_scope_and_an_extension_kill_nothing(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)
    host.manager.extend(sandbox_id, 600)
    host.docker.down = "connection refused"
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.NOT_DUE
    assert host.expiry.expire("sbx-other", "f" * 64, deadline) is Result.GONE
    assert host.systemd.killed == []
    assert host.journal.entries == []


def test_a_failed_removal_still_enforces_the_deadline(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)

    def refuse(backend_id: str) -> bool:
        raise HostError(f"Docker failed on {backend_id} (HTTP 500): driver busy")

    host.docker.remove = refuse  # type: ignore[method-assign]
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.KILLED
    assert host.systemd.killed == [(f"docker-{container}.scope", signal.SIGKILL)]
    assert len(host.expired()) == 1


def reaper_of(host: Host, tmp: Path) -> Reaper:
    return Reaper(
        host.manager,
        SliceManager(host.systemd),
        host.docker,
        auditor=Auditor(host.journal),
        config=lambda: ReaperConfig(state_dir=tmp / "state"),
        clock=lambda: host.now,
    )


def test_after_the_expiry_the_reaper_finds_nothing_and_audits_nothing(
    host: Host, tmp_path: Path
) -> None:
    sandbox_id, container = host.create(ttl=60)
    reaper = reaper_of(host, tmp_path)
    host.now = deadline = NOW + timedelta(seconds=60)
    assert reaper.run().plan == [], "while the timer runs its expiry, the sandbox is the timer's"
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.EXPIRED
    assert host.systemd.timers == {}, "the timer stopped with the scope it is bound to"
    assert reaper.run().plan == []
    assert [e["SLICEBOX_REAPER_RULE"] for e in host.journal.entries] == ["expired"]


def test_when_only_the_scope_was_killed_the_reaper_removes_the_container_as_exited(
    host: Host, tmp_path: Path
) -> None:
    sandbox_id, container = host.create(ttl=60)
    host.docker.down = "connection refused"
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.KILLED
    assert host.systemd.timers == {}, "the killed scope took its timer with it"
    host.docker.down = None
    host.docker.stop(container)
    done = reaper_of(host, tmp_path).run()
    assert [(a.kind, a.rule, a.target) for a in done.plan][:1] == [
        (Kind.DESTROY, Rule.EXITED, sandbox_id)
    ]
    assert host.docker.containers == {}
    rules = [e["SLICEBOX_REAPER_RULE"] for e in host.journal.entries]
    assert rules[:2] == ["expired", "exited"], "the expiry's story, then the removal's"


def test_a_usage_read_that_fails_costs_the_numbers_not_the_expiry(host: Host) -> None:
    sandbox_id, container = host.create(ttl=60)
    broken = host.cgroupfs / PROJECT_CGROUP / f"docker-{container}.scope" / "cpu.stat"
    broken.unlink()
    broken.mkdir()  # a read answers EISDIR: not "vanished", an error the reader raises
    host.now = deadline = NOW + timedelta(seconds=60)
    assert host.expiry.expire(sandbox_id, container, deadline) is Result.EXPIRED
    [record] = host.expired()
    assert "SLICEBOX_USAGE_CPU_SECONDS" not in record
    assert host.docker.containers == {}
