"""Finding and killing an exec's processes in a sandbox cgroup, on a fake /proc and cgroupfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from slicebox.host.procs import (
    CLOCK_TICKS,
    CgroupHost,
    ProcInfo,
    cgroup_from_proc,
    exec_members,
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


def test_parse_oom_kills_and_cgroup_line() -> None:
    assert parse_oom_kills("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n") == 2
    assert parse_oom_kills("low 0\n") is None
    assert (
        cgroup_from_proc("0::/slicebox.slice/docker-x.scope\n") == "/slicebox.slice/docker-x.scope"
    )
    with pytest.raises(HostError, match="cgroup v2"):
        cgroup_from_proc("1:memory:/x\n")


class FakeKernel:
    """A fake /proc and cgroup directory; SIGKILL removes the process (children reparent)."""

    def __init__(self, root: Path, table: list[ProcInfo]) -> None:
        self.proc = root / "proc"
        self.cgroup = root / "cg"
        self.cgroup.mkdir(parents=True)
        self.table = {p.pid: p for p in table}
        self.signalled: list[int] = []
        self.sync()

    def sync(self) -> None:
        (self.cgroup / "cgroup.procs").write_text("".join(f"{p}\n" for p in self.table))
        for p in self.table.values():
            (self.proc / str(p.pid)).mkdir(parents=True, exist_ok=True)
            stat = f"{p.pid} (x y) S {p.ppid} {p.pid} {p.session} {STAT_TAIL} {p.started} 1 2"
            (self.proc / str(p.pid) / "stat").write_text(stat)

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.table:
            raise ProcessLookupError(pid)
        self.signalled.append(pid)
        self.table.pop(pid)
        for child in [c for c in self.table.values() if c.ppid == pid]:
            self.table[child.pid] = ProcInfo(child.pid, 1, child.session, child.started)
        self.sync()

    def host(self) -> CgroupHost:
        return CgroupHost(
            cgroup_root=self.cgroup.parent, proc=self.proc, kill=self.kill, sleep=lambda s: None
        )

    def session(self, session: int) -> list[int]:
        return sorted(p.pid for p in self.table.values() if p.session == session)


def test_kill_exec_leaves_only_what_is_not_the_execs(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE)
    assert kernel.host().kill_exec(kernel.cgroup, 10, SINCE) == 5
    assert sorted(kernel.table) == NOT_THE_EXECS
    assert sorted(kernel.signalled) == [10, 11, 12, 13, 14]


def test_a_fork_bomb_whose_first_shell_exited_is_killed_whole(tmp_path: Path) -> None:
    """The issue's bomb: the exec's own shell is gone, its forks are orphans of init."""
    bomb = [ProcInfo(11, 1, 10, 501), ProcInfo(12, 11, 10, 502), ProcInfo(13, 1, 10, 503)]
    others = [p for p in TABLE if p.pid in NOT_THE_EXECS]
    kernel = FakeKernel(tmp_path, others + bomb)
    assert kernel.host().kill_exec(kernel.cgroup, 10, SINCE) == 3
    assert kernel.session(10) == []
    assert sorted(kernel.table) == NOT_THE_EXECS


def test_kill_exec_never_touches_pids_outside_the_cgroup(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE[:3])
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
