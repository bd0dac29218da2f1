"""Finding and killing an exec's processes in a sandbox cgroup, on a fake /proc and cgroupfs."""

from __future__ import annotations

from itertools import count
from pathlib import Path

import pytest

from slicebox.host import procs
from slicebox.host.procs import (
    CLOCK_TICKS,
    CgroupHost,
    ProcInfo,
    cgroup_from_proc,
    exec_members,
    is_frozen,
    parse_oom_kills,
    parse_stat,
)
from slicebox.model.errors import HostError

STAT_TAIL = "0 -1 4194560 0 0 0 0 1 2 0 0 20 0 1 0"  # tty_nr .. itrealvalue


def test_parse_stat_survives_odd_command_names() -> None:
    info = parse_stat(12, f"12 (a) b (c)) S 7 12 9 {STAT_TAIL} 4321 8192 3")
    assert info == ProcInfo(pid=12, ppid=7, session=9, started=4321)


# The exec 10 began at tick 500 and leads session 10 (runc makes every exec a session leader).
# Before it: init 1 -> main 2, an earlier exec's daemon 30 (own session) -> 31. The exec's tree
# 10 -> 11 -> 12, and 11 -> 14 which started a session of its own; 13 was the exec's child,
# reparented to init when its parent died. Alongside it: another exec 20 and its orphan 21, and
# 15, a daemon (own session, parent dead) started after the exec began.
SINCE = 500
PIDS_MAX = 40  # the fake bomb's limit; small, so that the racing rounds stay quick
TABLE = [
    ProcInfo(1, 0, 1, 100),
    ProcInfo(2, 1, 1, 100),
    ProcInfo(30, 1, 30, 200),
    ProcInfo(31, 30, 30, 210),
    ProcInfo(10, 0, 10, 500),
    ProcInfo(11, 10, 10, 501),
    ProcInfo(12, 11, 10, 502),
    ProcInfo(13, 1, 10, 503),
    ProcInfo(14, 11, 14, 504),
    ProcInfo(20, 0, 20, 600),
    ProcInfo(21, 1, 20, 601),
    ProcInfo(15, 1, 15, 700),
]
NOT_THE_EXECS = [1, 2, 15, 20, 21, 30, 31]


def test_exec_members_are_its_session_and_descendants() -> None:
    assert exec_members(10, SINCE, TABLE) == {10, 11, 12, 13, 14}


def test_exec_members_outlive_the_exec_itself() -> None:
    """A fork bomb's first shell exits at once: its processes are orphans of init by the time
    the exec times out, and still in its session."""
    gone = {10, 11}
    table = [p if p.ppid not in gone else ProcInfo(p.pid, 1, p.session, p.started) for p in TABLE]
    table = [p for p in table if p.pid not in gone]
    assert exec_members(10, SINCE, table) == {12, 13}, "14 left both: a daemon now"


def test_exec_members_are_never_older_than_the_exec() -> None:
    assert exec_members(1, SINCE, TABLE) == set(), "init's pid by mistake: nothing is taken"
    assert exec_members(30, SINCE, TABLE) == set()


def test_parse_oom_kills_events_and_cgroup_line() -> None:
    assert parse_oom_kills("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n") == 2
    assert parse_oom_kills("low 0\n") is None
    assert is_frozen("populated 1\nfrozen 1\n")
    assert not is_frozen("populated 1\nfrozen 0\n")
    assert not is_frozen(None)
    assert (
        cgroup_from_proc("0::/slicebox.slice/docker-x.scope\n") == "/slicebox.slice/docker-x.scope"
    )
    with pytest.raises(HostError, match="cgroup v2"):
        cgroup_from_proc("1:memory:/x\n")


class FakeKernel:
    """A fake /proc and cgroup directory that moves on one step at each kill and each sleep of
    the host, the only moments time passes for it.

    SIGKILL removes a process, frozen or not (cgroup v2 delivers it to frozen processes), and
    its children reparent to init. With ``freezer`` the cgroup has cgroup.freeze: freezing
    takes a step once 1 is written there, and then cgroup.events says so. With ``bomb``, at
    each step the cgroup is not frozen every process of that session forks a child, up to the
    pids limit, and the eldest of them exits, leaving its children to init.
    """

    def __init__(
        self, root: Path, table: list[ProcInfo], *, freezer: bool = False, bomb: int = 0
    ) -> None:
        self.proc = root / "proc"
        self.cgroup = root / "cg"
        self.cgroup.mkdir(parents=True)
        self.table = {p.pid: p for p in table}
        self.bomb = bomb
        self.pids = count(1000)
        self.signalled: list[int] = []
        self.forks = 0
        self.stopped = False
        self.written: dict[int, ProcInfo] = {}
        if freezer:
            (self.cgroup / "cgroup.freeze").write_text("0\n")
        self.sync()

    @property
    def freeze(self) -> Path:
        return self.cgroup / "cgroup.freeze"

    def frozen(self) -> bool:
        return self.freeze.exists() and self.freeze.read_text().strip() == "1"

    def step(self) -> None:
        if not self.stopped:
            self.fork_bomb()
        self.stopped = self.frozen()
        if self.freeze.exists():
            (self.cgroup / "cgroup.events").write_text(f"populated 1\nfrozen {self.stopped:d}\n")
        self.sync()

    def fork_bomb(self) -> None:
        bombs = [p for p in self.table.values() if self.bomb and p.session == self.bomb]
        for parent in bombs:
            if len(self.table) < PIDS_MAX:
                child = next(self.pids)
                self.table[child] = ProcInfo(child, parent.pid, self.bomb, SINCE + 10)
                self.forks += 1
        if bombs:
            self.exit(bombs[0].pid)

    def exit(self, pid: int) -> None:
        self.table.pop(pid)
        for child in [c for c in self.table.values() if c.ppid == pid]:
            self.table[child.pid] = ProcInfo(child.pid, 1, child.session, child.started)

    def sync(self) -> None:
        (self.cgroup / "cgroup.procs").write_text("".join(f"{p}\n" for p in self.table))
        for p in self.table.values():
            if self.written.get(p.pid) == p:
                continue
            self.written[p.pid] = p
            (self.proc / str(p.pid)).mkdir(parents=True, exist_ok=True)
            stat = f"{p.pid} (x y) S {p.ppid} {p.pid} {p.session} {STAT_TAIL} {p.started} 1 2"
            (self.proc / str(p.pid) / "stat").write_text(stat)

    def kill(self, pid: int, sig: int) -> None:
        self.step()  # what forked between the host's look at the table and this kill
        if pid not in self.table:
            raise ProcessLookupError(pid)
        self.signalled.append(pid)
        self.exit(pid)
        self.sync()

    def sleep(self, seconds: float) -> None:
        self.step()

    def host(self) -> CgroupHost:
        return CgroupHost(
            cgroup_root=self.cgroup.parent, proc=self.proc, kill=self.kill, sleep=self.sleep
        )

    def session(self, session: int) -> list[int]:
        return sorted(p.pid for p in self.table.values() if p.session == session)


def test_kill_exec_leaves_only_what_is_not_the_execs(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE)
    assert kernel.host().kill_exec(kernel.cgroup, 10, SINCE) == 5
    assert sorted(kernel.table) == NOT_THE_EXECS
    assert sorted(kernel.signalled) == [10, 11, 12, 13, 14]


@pytest.mark.parametrize("freezer", [True, False])
def test_a_fork_bomb_whose_first_shell_exited_is_killed_whole(
    tmp_path: Path, freezer: bool
) -> None:
    """The issue's bomb: the exec's own shell is gone, its forks are orphans of init."""
    bomb = [ProcInfo(11, 1, 10, 501), ProcInfo(12, 11, 10, 502), ProcInfo(13, 1, 10, 503)]
    others = [p for p in TABLE if p.pid in NOT_THE_EXECS]
    kernel = FakeKernel(tmp_path, others + bomb, freezer=freezer, bomb=10 if freezer else 0)
    assert kernel.host().kill_exec(kernel.cgroup, 10, SINCE) >= 3
    assert kernel.session(10) == []
    assert sorted(kernel.table) == NOT_THE_EXECS
    assert not kernel.frozen()


def test_forks_cannot_outrun_the_kill_with_the_scope_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process of the bomb forks between any look at the table and any kill, unless the
    scope is frozen: without the freezer no number of rounds catches them all."""
    bomb = [ProcInfo(10, 0, 10, 500), ProcInfo(11, 10, 10, 501)]
    others = [p for p in TABLE if p.pid in NOT_THE_EXECS]
    racing = FakeKernel(tmp_path / "racing", others + bomb, bomb=10)
    monkeypatch.setattr(procs, "KILL_ROUNDS", 5)  # the 50 would only take longer
    with pytest.raises(HostError, match="survived"):
        racing.host().kill_exec(racing.cgroup, 10, SINCE)
    kernel = FakeKernel(tmp_path / "frozen", others + bomb, freezer=True, bomb=10)
    kernel.host().kill_exec(kernel.cgroup, 10, SINCE)
    assert kernel.forks > 0, "the bomb forked until the scope froze"
    assert kernel.session(10) == []
    assert sorted(kernel.table) == NOT_THE_EXECS
    assert not kernel.frozen()


def test_the_scope_is_thawed_when_a_kill_fails(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE, freezer=True)

    def refuse(pid: int, sig: int) -> None:
        raise PermissionError(pid)

    host = CgroupHost(cgroup_root=tmp_path, proc=kernel.proc, kill=refuse, sleep=kernel.sleep)
    with pytest.raises(PermissionError):
        host.kill_exec(kernel.cgroup, 10, SINCE)
    assert not kernel.frozen()


def test_a_paused_sandbox_is_killed_in_and_stays_paused(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE, freezer=True)
    kernel.freeze.write_text("1\n")
    kernel.step()
    assert kernel.host().kill_exec(kernel.cgroup, 10, SINCE) == 5
    assert sorted(kernel.table) == NOT_THE_EXECS
    assert kernel.frozen()


def test_a_scope_that_does_not_freeze_is_killed_anyway_and_thawed(tmp_path: Path) -> None:
    """A process in uninterruptible sleep can hold a freeze off for as long as it sleeps."""
    kernel = FakeKernel(tmp_path, TABLE, freezer=True)
    sleeps: list[float] = []

    def never_frozen(seconds: float) -> None:
        sleeps.append(seconds)
        (kernel.cgroup / "cgroup.events").write_text("populated 1\nfrozen 0\n")

    host = CgroupHost(cgroup_root=tmp_path, proc=kernel.proc, kill=kernel.kill, sleep=never_frozen)
    assert host.kill_exec(kernel.cgroup, 10, SINCE) == 5
    assert sorted(kernel.table) == NOT_THE_EXECS
    assert not kernel.frozen()
    assert sum(sleeps) < 5, "each round waits for the freeze about a second, no longer"


def test_kill_exec_never_touches_pids_outside_the_cgroup(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE[:3], freezer=True)
    assert kernel.host().kill_exec(kernel.cgroup, 999, SINCE) == 0
    assert kernel.signalled == []


def test_kill_exec_gives_up_on_unkillable_processes(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE)
    host = CgroupHost(
        cgroup_root=tmp_path, proc=kernel.proc, kill=lambda p, s: None, sleep=lambda s: None
    )
    with pytest.raises(HostError, match="survived"):
        host.kill_exec(kernel.cgroup, 10, SINCE)


def test_the_process_clock_counts_ticks_since_boot_rounded_down() -> None:
    host = CgroupHost(clock=lambda: 12.3456)
    assert host.process_clock() == int(12.3456 * CLOCK_TICKS)


def test_cgroup_of_and_oom_kills_read_the_files(tmp_path: Path) -> None:
    (tmp_path / "proc" / "5").mkdir(parents=True)
    (tmp_path / "proc" / "5" / "cgroup").write_text("0::/a.slice/b.scope\n")
    host = CgroupHost(cgroup_root=tmp_path / "cg", proc=tmp_path / "proc")
    cgroup = host.cgroup_of(5)
    assert cgroup == tmp_path / "cg" / "a.slice" / "b.scope"
    assert host.oom_kills(cgroup) is None, "a missing file is no value, not 0"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.events").write_text("oom 1\noom_kill 1\n")
    assert host.oom_kills(cgroup) == 1
    with pytest.raises(HostError, match="vanished"):
        host.cgroup_of(6)
    assert host.cgroup_at("/a.slice/b.scope") == cgroup == host.cgroup_at("a.slice/b.scope")


@pytest.mark.parametrize("freezer", [True, False])
def test_kill_since_takes_everything_a_reused_member_s_run_started_and_nothing_older(
    tmp_path: Path, freezer: bool
) -> None:
    """A reuse release: every process started at or after the acquire's mark goes, daemons
    and other sessions included; the container's init and main process (and whatever ran
    before the acquire) stay."""
    kernel = FakeKernel(tmp_path, TABLE, freezer=freezer)
    assert kernel.host().kill_since(kernel.cgroup, SINCE) == 8
    assert sorted(kernel.table) == [1, 2, 30, 31]
    assert not kernel.frozen()
